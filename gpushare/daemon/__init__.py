"""The daemon's life cycle: node setup -> engine workers -> HTTP; signals, reloads, drain, sd_notify."""
