"""Segments and conflict-checked merges: `kprof export`, `kprof merge` (see kprof.merge.export and kprof.merge.merge)."""
