"""Benchmarks of pagedserve against its peers (`python -m benchmarks.peers`); not part of the package or of
`make test`."""
