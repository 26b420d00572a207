"""dlojz_pack.py's library: what SRC holds (source), which image goes in which shard (plan), the writer (writer)."""
