"""What a run records, as pure formats and arithmetic: no I/O, no SQL, no HTTP.

- `codecs.py`: how the store packs token ids, logprobs and version spans into a row of its
  `calls` table, and spans as per-token versions
- `merge.py`: a session's calls merged into trajectory samples, one call at a time
  (`SampleMerger`) or all at once (`merge_calls`)
- `advantages.py`: group-relative advantages (GRPO, RLOO, Dr. GRPO), the weight on negative
  ones, `AdvantageSpec` (how a run computes them) and which rollouts of a group count
- `metrics_file.py`: metrics.jsonl, the keys of a step record and the file's one reader

The store writes and reads with these, the coordinator trains with them and the viewer shows
them, so all of them tell one story. May import: the foundation (schema) only.
"""
