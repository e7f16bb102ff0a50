"""The second KV tier on the runner's side: block files on disk, written in the background, read on restore."""
