"""Deployment material: the systemd unit, an example config, and the emulated-WAN testbed."""
