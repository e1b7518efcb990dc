"""Config blocks are generated from their dataclasses: every field is a ``--config`` key."""

import dataclasses

from absl import flags
from ml_collections import config_flags

from experiments import cli, run_spec
from lm import config as model_config
from optim import registry, spec


def parsed(*overrides: str):
    """The default config with ``--config.<key>=<value>`` overrides applied by absl, as on the command line."""
    values, argv = flags.FlagValues(), ["prog", *overrides]
    config_flags.DEFINE_config_file("config", cli.DEFAULT_CONFIG, flag_values=values, lock_config=True, sys_argv=argv)
    values(argv)
    return values.config


def test_every_model_field_is_reachable_from_the_command_line():
    unset = {f.name: 1 for f in dataclasses.fields(model_config.ModelConfig) if f.default is None}  # X | None keys
    expected = dataclasses.replace(model_config.ModelConfig(), **unset)
    fields = dataclasses.fields(model_config.ModelConfig)
    config = parsed(*(f"--config.model.{f.name}={getattr(expected, f.name)}" for f in fields))
    assert {f.name: config.model[f.name] for f in fields} == dataclasses.asdict(expected)
    assert run_spec.model_config(config) == expected  # each key reaches the model, over the preset


def test_unset_model_keys_keep_the_preset():
    config = parsed("--config.model.preset=llama-1b", "--config.model.n_layers=2")
    cfg = run_spec.model_config(config)
    llama = model_config.from_preset("llama-1b")
    assert (cfg.n_layers, cfg.rope_theta, cfg.norm_eps, cfg.vocab_size) == (2, llama.rope_theta, llama.norm_eps, llama.vocab_size)


def test_every_optimizer_block_holds_its_spec_s_configurable_fields():
    config = parsed("--config.optimizer.shampoo.precondition_every=7")
    assert config.optimizer.shampoo.precondition_every == 7
    for name, cls in registry.OPTIMIZERS.items():
        keys = set(config.optimizer[name])
        assert keys == set(spec.config_defaults(cls)), name
        assert ("inner" in keys) == issubclass(cls, spec.WrapperSpec), name
