"""Worker scripts of `bench.py rl-step`, one per framework; each runs as a script in its own
process (peers in their own virtual environments), never imported by jaxrl."""
