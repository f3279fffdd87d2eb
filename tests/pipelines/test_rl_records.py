"""The RL loop's rollout record of a batch (pipelines/rl_records.py), on a hand-made batch."""

from __future__ import annotations

from pathlib import Path

import torch

from roll_core.config.rlvr import RolloutRecordsConfig
from roll_core.pipelines.rl_records import RolloutRecorder
from roll_core.rollout.agentic.batch import trajectory_batch
from roll_core.rollout.agentic.episode import Trajectory, Turn
from roll_core.rollout.batch import build_rl_batch
from roll_core.rollout.one_turn import Prompt, Sample
from roll_core.tracking.rollouts import read_step


def sample(uid: int, group: int, reward: float, version: int = 0) -> Sample:
    return Sample(
        uid=uid,
        group=group,
        prompt=Prompt(index=group, prompt_ids=[5, 6 + group], row={}),
        response_ids=[20 + uid, 30 + uid],
        log_probs=[-0.5 - uid, -1.0 - uid],
        finish_reason="stop" if uid % 2 else "length",
        policy_version=version,
        reward=reward,
        reward_info={"domain": "math", "correct": reward > 0, "extracted": "7", "x": [1]},
    )


def test_the_record_of_a_step_holds_whole_groups_aligned_token_by_token(tmp_path: Path) -> None:
    groups = [[sample(0, 0, 1.0), sample(1, 0, 0.0)], [sample(2, 1, 0.0, 1), sample(3, 1, 1.0, 1)]]
    batch = build_rl_batch(groups, pad_id=0)
    t = batch.tensors
    t["old_log_probs"] = t["behaviour_log_probs"] - 0.25 * t["response_mask"]
    t["advantages"] = t["response_mask"] * t["scores"].unsqueeze(1)
    t["response_mask"][3, 1] = 0.0  # row 3: its first response token (token 2) rejected
    rec = RolloutRecorder(
        RolloutRecordsConfig(samples_per_step=2), tmp_path, tokenizer=None, start=0
    )
    assert rec.record(2, batch, groups)
    head, rows = read_step(tmp_path, 2)
    assert len(rows) == 2 and rows[0]["group"] == rows[1]["group"], "one whole group"
    assert head["summary"]["batch_rows"] == 4 and head["summary"]["rows"] == 2
    by_row = {r["row"]: r for r in rows}
    for i, r in by_row.items():
        s = groups[i // 2][i % 2]
        # prompt [5, 6+g] then the response: the first generated token is token 2
        assert r["ids"] == [5, 6 + s.group, 20 + s.uid, 30 + s.uid] and r["start"] == 2
        assert r["tokens"] == [str(x) for x in r["ids"]]  # no tokenizer: the ids
        assert r["behaviour_lp"] == s.log_probs
        assert r["trainer_lp"] == [s.log_probs[0] - 0.25, s.log_probs[1] - 0.25]
        assert r["advantage"] == [s.reward, s.reward] and r["generated"] == [1, 1]
        assert r["reward"] == s.reward and r["finish_reason"] == s.finish_reason
        assert r["policy_version"] == s.policy_version
        assert r["staleness"] == 1 - s.policy_version  # step 2 samples from version 1
        assert r["reward_parts"] == {"domain": "math", "correct": s.reward > 0, "extracted": "7"}
        assert r["env"] == "math" and r["is_weight"] is None and r["ref_lp"] is None
        assert r["mask"] == ([0.0, 1.0] if i == 3 else [1.0, 1.0])


def test_trainer_log_probs_come_from_the_callable_when_the_update_makes_its_own(
    tmp_path: Path,
) -> None:
    groups = [[sample(0, 0, 1.0), sample(1, 0, 0.0)]]
    batch = build_rl_batch(groups, pad_id=0)
    batch.tensors["advantages"] = torch.zeros_like(batch.tensors["response_mask"])
    seen = []

    def trainer(sub):
        seen.append(len(sub))
        lp = sub.tensors["behaviour_log_probs"]
        entropy = torch.arange(lp.shape[1], dtype=torch.float32).expand_as(lp) + 0.5
        return {"log_probs": torch.full_like(lp, -2.0), "entropy": entropy}

    rec = RolloutRecorder(RolloutRecordsConfig(), tmp_path, tokenizer=None, start=0)
    assert rec.record(1, batch, groups, trainer_log_probs=trainer)
    _, rows = read_step(tmp_path, 1)
    assert seen == [2] and [r["trainer_lp"] for r in rows] == [[-2.0, -2.0]] * 2
    # the entropies of target positions 1 and 2 (tokens 2 and 3, the response)
    assert [r["entropy"] for r in rows] == [[1.5, 2.5]] * 2
    assert "old_log_probs" not in batch.tensors, "the training batch is left as it was"
    # the batch's own old log-probs stay; the entropies still come from the trainer
    batch.tensors["old_log_probs"] = batch.tensors["behaviour_log_probs"] - 1.0
    assert rec.record(2, batch, groups, trainer_log_probs=trainer)
    _, rows = read_step(tmp_path, 2)
    assert [r["trainer_lp"] for r in rows] == [[lp - 1.0 for lp in r["behaviour_lp"]] for r in rows]
    assert [r["entropy"] for r in rows] == [[1.5, 2.5]] * 2


def turn(action: str, reward: float, segment: int = 0) -> Turn:
    return Turn(
        prompt_ids=[1],
        response_ids=[3],
        log_probs=[-0.1],
        finish_reason="stop",
        policy_version=0,
        action=action,
        reward=reward,
        state_key="s",
        action_is_valid=True,
        gen_s=0.0,
        env_s=0.0,
        segment=segment,
    )


def test_an_episode_row_holds_its_turns_and_its_conversation(tmp_path: Path) -> None:
    traj = Trajectory(tag="calc", group=7, seed=3, index=0, status="done", episode_return=1.0)
    traj.trace.add_context([1, 2])  # system + task
    traj.trace.add_generated([3, 4], [-0.5, -0.25])  # the tool call
    traj.trace.add_context([5])  # the tool's result
    traj.trace.add_generated([6], [-1.0])  # the answer
    traj.turns = [turn("call", 0.0), turn("answer", 1.0)]
    batch = trajectory_batch([[traj]], pad_id=0)
    batch.tensors["advantages"] = batch.tensors["response_mask"] * 2.0
    rec = RolloutRecorder(RolloutRecordsConfig(), tmp_path, tokenizer=None, start=0)
    assert rec.record(1, batch, [[traj]])
    [row] = read_step(tmp_path, 1)[1]
    assert row["ids"] == [1, 2, 3, 4, 5, 6] and row["start"] == 2
    assert row["generated"] == [1, 1, 0, 1]
    assert row["behaviour_lp"] == [-0.5, -0.25, 0.0, -1.0]
    assert row["mask"] == [1.0, 1.0, 0.0, 1.0] and row["advantage"] == [2.0, 2.0, 0.0, 2.0]
    assert row["conversation"] == [
        {"role": "context", "start": 0, "text": "1 2"},
        {"role": "model", "start": 2, "text": "3 4"},
        {"role": "context", "start": 4, "text": "5"},
        {"role": "model", "start": 5, "text": "6"},
    ]
    assert row["env"] == "calc" and row["prompt_key"] == "calc:3" and row["reward"] == 1.0
    episode = row["episode"]
    assert (episode["status"], episode["return"], episode["parts"]) == ("done", 1.0, 1)
    assert [t["action"] for t in episode["turns"]] == ["call", "answer"]
    assert row["reward_parts"] == {"turn_rewards": [0.0, 1.0]}
    assert row["finish_reason"] == "stop"
