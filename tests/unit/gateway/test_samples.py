from lockgate.gateway.records.merge import merge_calls
from lockgate.gateway.schema import CallRecord, VersionSpan


def _call(index: int, prompt: list[int], completion: list[int], version: int = 0) -> CallRecord:
    return CallRecord(
        session_id="s",
        index=index,
        request={},
        sampling={},
        prompt_ids=prompt,
        completion_ids=completion,
        logprobs=[-0.5 - i for i in range(len(completion))],
        versions=[VersionSpan(version=version, start=0, end=len(completion))],
        finish_reason="stop",
        replica="r",
        started_at=0.0,
        ended_at=0.0,
        extends_previous=True,
    )


def test_extending_calls_merge_into_one_sample_with_mask_on_sampled_tokens_only() -> None:
    calls = [
        _call(0, [1, 2, 3], [4, 5], version=0),
        _call(1, [1, 2, 3, 4, 5, 6, 7], [8], version=1),
    ]
    samples, splits = merge_calls(calls)
    assert splits == 0
    assert len(samples) == 1
    s = samples[0]
    assert s.input_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    assert s.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert s.logprobs == [0.0, 0.0, 0.0, -0.5, -1.5, 0.0, 0.0, -0.5]
    assert s.versions == [-1, -1, -1, 0, 0, -1, -1, 1]
    assert s.call_indices == [0, 1]


def test_a_call_that_does_not_extend_the_previous_tokens_starts_a_new_sample_and_counts_a_split() -> (
    None
):
    calls = [_call(0, [1, 2, 3], [4, 5]), _call(1, [1, 2, 9, 4, 5, 6], [7])]
    samples, splits = merge_calls(calls)
    assert splits == 1
    assert [s.input_ids for s in samples] == [[1, 2, 3, 4, 5], [1, 2, 9, 4, 5, 6, 7]]
    assert samples[1].loss_mask == [0, 0, 0, 0, 0, 0, 1]


def test_versions_follow_the_recorded_spans() -> None:
    call = _call(0, [1], [2, 3, 4])
    call.versions = [VersionSpan(version=3, start=0, end=2), VersionSpan(version=4, start=2, end=3)]
    samples, _ = merge_calls([call])
    assert samples[0].versions == [-1, 3, 3, 4]
