"""What kind of process this is, for the library's choices that depend on it (imports nothing)."""

one_shot = False  # set by a CLI verb while it runs: it looks up once, so a lookup helper would start too late
