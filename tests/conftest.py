"""Test setup: eight fake CPU devices, so sharded code paths run on any laptop or CI box."""

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
