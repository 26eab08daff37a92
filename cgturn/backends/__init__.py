"""Two ways to own processes behind one interface: per-turn cgroups, or a registry of spawned pids."""
