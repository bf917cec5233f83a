"""The simulated executor and the device and model profiles it costs waves with."""
