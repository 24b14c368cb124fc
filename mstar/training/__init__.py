"""Training the small real Kimi K3 pair (target + DSpark draft) that ships with mstar."""
