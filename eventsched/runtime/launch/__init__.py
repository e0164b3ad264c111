"""Starting jobs: the executor, the zygote, the per-job supervisor, cgroups, terminal sessions, script paths."""
