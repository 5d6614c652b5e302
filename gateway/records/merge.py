"""A session's calls merged into trajectory samples, the sequences a run trains on.

A call whose prompt starts with the current sample's exact tokens extends that sample: the new
prompt tokens join with loss mask 0, the completion with mask 1. Any other call starts a new
sample and the split is counted, so history the agent edited or the renderer could not bridge
is never trained on as if it had been sampled. An interrupted call (cut by a sync and never
answered to the agent, so no later call builds on it) joins no sample.

`SampleMerger` applies the rule one call at a time and says where each call went, for a reader
that shows calls (the viewer); `merge_calls` is the whole session at once (the coordinator's
samples, through the gateway's admin API).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lockgate.gateway.records.codecs import token_versions
from lockgate.gateway.schema import CallRecord, TrajectorySample


@dataclass(frozen=True)
class Placement:
    """Where one call's tokens went in its session's samples."""

    trained: bool  # its completion joined a sample (an interrupted call's never does)
    extends: bool  # its prompt starts with the current sample's tokens
    new_from: int  # its prompt's tokens from here on are new to the sample (0: the whole prompt)
    split: bool  # it began a sample after the first: a re-render split

    @property
    def new_sample(self) -> bool:
        """It began a sample (the first, or after a split)."""
        return self.trained and not self.extends


class SampleMerger:
    """The merging rule, fed a session's calls in order."""

    def __init__(self) -> None:
        self.samples: list[TrajectorySample] = []
        self.splits = 0  # samples begun after the first

    def add(self, call: CallRecord) -> Placement:
        current = self.samples[-1] if self.samples else None
        extends = current is not None and _extends(call.prompt_ids, current.input_ids)
        new_from = len(current.input_ids) if extends and current is not None else 0
        trained = call.finish_reason != "interrupted"
        split = trained and not extends and current is not None
        if not trained:
            return Placement(trained=False, extends=extends, new_from=new_from, split=False)
        if current is None or not extends:
            self.splits += int(split)
            current = TrajectorySample(
                input_ids=[], loss_mask=[], logprobs=[], versions=[], call_indices=[]
            )
            self.samples.append(current)
        new_prompt = call.prompt_ids[new_from:]
        n_prompt = len(new_prompt)
        current.input_ids.extend(new_prompt)
        current.loss_mask.extend([0] * n_prompt)
        current.logprobs.extend([0.0] * n_prompt)
        current.versions.extend([-1] * n_prompt)
        current.input_ids.extend(call.completion_ids)
        current.loss_mask.extend([1] * len(call.completion_ids))
        current.logprobs.extend(call.logprobs)
        current.versions.extend(token_versions(call.versions, len(call.completion_ids)))
        current.call_indices.append(call.index)
        return Placement(trained=True, extends=extends, new_from=new_from, split=split)


def merge_calls(calls: Sequence[CallRecord]) -> tuple[list[TrajectorySample], int]:
    """Return the merged samples and the number of splits (new samples after the first)."""
    merger = SampleMerger()
    for call in calls:
        merger.add(call)
    return merger.samples, merger.splits


def _extends(prompt: Sequence[int], prefix: Sequence[int]) -> bool:
    n = len(prefix)
    return len(prompt) >= n and list(prompt[:n]) == list(prefix)
