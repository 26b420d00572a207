"""The parts of dlojz_pack.py's shard writer: what SRC holds (source) and which image goes in which shard (plan)."""
