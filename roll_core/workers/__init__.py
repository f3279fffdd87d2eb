"""Role logic (ActorTrain, ...): no Ray here."""
