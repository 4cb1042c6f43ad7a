"""Checks before a run starts: names it refers to, Hub reachability, FlowerTune's rules."""
