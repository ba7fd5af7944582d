"""The entry point (`main`, Hydra's) and the commands: each a short recipe of the lifecycle's phases (`app`),
and what `list` and `logs` print (`listing`). The outermost layer: nothing imports it."""
