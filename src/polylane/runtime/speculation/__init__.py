"""Speculative decoding's execution: drafters (`drafters`), one-pass verification (`verify`), the
per-model speculator (`speculator`), drafts under a grammar (`grammar`), the engine's setup of
drafters (`setup`) and the offline speculative generate (`generate`). The rules are in
`policy/speculation/`."""
