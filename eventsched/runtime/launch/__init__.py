"""Starting jobs: the executor, the zygote, the per-job supervisor and its plan, cgroups, terminal sessions."""
