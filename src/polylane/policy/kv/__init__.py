"""KV blocks as numbers: the pool of fixed-size blocks and their reference counts (`blocks`), a
sequence's block table with fork, copy-on-write, truncate and compact (`sequence_blocks`), the
radix prefix tree that caches whole blocks of prompts (`radix`), and one model's KV manager that
the scheduler decides with: admission at a prefix hit, reservation, commit, close (`manager`)."""
