"""Search for the fastest plan that fits: Mist's space and the baselines' spaces."""
