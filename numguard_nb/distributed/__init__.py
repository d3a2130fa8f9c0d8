"""What runs across processes: one home for `torch.distributed` work.

- `flags`: which rank made the first non-finite value, carried on the gradient reduction every
  rank makes anyway (a DDP communication hook, FSDP2's reduce-scatter): no extra collective, no
  host read in a healthy step. The guard acts on it in `guard.rank_reports`.
- `check`: the network check, `torchrun --nproc_per_node 2 -m numguard_nb.distcheck` or
  `numguard_nb.distcheck.run()` from a notebook: can the world form, are the collectives'
  results right, how fast; it never hangs.

Limits: one process group (the model's); the flags need DDP's default hook or FSDP2's default
reduce-scatter (a hook of the user's keeps its place, and reports then do not name the rank).
"""
