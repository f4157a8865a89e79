"""Running gpushare as a systemd service: sd_notify and the watchdog (notify), journald
logging (logs), and `gpushare service install` with the unit files it ships (install,
files/)."""
