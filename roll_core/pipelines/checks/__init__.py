"""The recipe checks of each RL pipeline (checks/rlvr.py, checks/agentic.py): what a recipe
asks for that the pipeline cannot run, found before a model is loaded. The pipeline's plan
runs them (so `roll validate` and `--dry-run` report them) and its `prepare` runs them again
with the tokenizer and envs at hand."""
