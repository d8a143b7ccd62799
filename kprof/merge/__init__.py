"""Segments and conflict-checked merges: `kprof export`, `kprof merge` (see kprof.merge.merge)."""
