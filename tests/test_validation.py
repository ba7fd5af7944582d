"""Config validation: one clear line naming the key and the allowed values, exit 2, and no MLflow run."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from orchestrator import CONF_DIR
from orchestrator.config.settings import JobConfig, SSHSettings
from orchestrator.config.validation import ConfigError, check_group_choices, resolve_config
from remote_worker.experiments import EXPERIMENTS
from remote_worker.spec import EXPERIMENT_NAMES
from tests.conftest import run_orchestrator

MODELS = ", ".join(sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml")))


def composed(overrides: list[str]) -> dict:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return resolve_config(compose(config_name="config", overrides=overrides))


def test_default_config_is_valid() -> None:
    config = composed([])
    assert config["host"]["kind"] == "local"
    assert config["model"]["name"] == "tiny_trained"
    assert config["experiment"]["name"] == "ddtree_gdn"
    assert config["tracking"]["uri"].startswith("sqlite:///")


def test_unknown_group_choice_names_group_and_options() -> None:
    with pytest.raises(ConfigError) as err:
        check_group_choices(["model=tiny_hybird"], CONF_DIR)
    assert str(err.value) == f"model='tiny_hybird' is not one of: {MODELS}"


def test_unknown_choice_inside_a_sweep_is_rejected() -> None:
    with pytest.raises(ConfigError, match="host='gpu9' is not one of: kpro5, local, localhost_ssh"):
        check_group_choices(["-m", "host=local,gpu9"], CONF_DIR)


def test_valid_choices_and_plain_keys_pass() -> None:
    check_group_choices(["model=tiny_dense,tiny_hybrid", "seed=3", "hydra/launcher=basic", "--cfg", "job"], CONF_DIR)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.dtype=float17", "model.dtype='float17' is not one of: float32, float64, bfloat16, float16"),
        ("model.device=tpu", "model.device='tpu' is not one of: auto, cpu, cuda"),
        ("model.path=null", "model.path must name a checkpoint directory when model.source='pretrained'"),
        ("tracking.uri=ftp://x", "tracking.uri='ftp://x' must start with sqlite:///... or file:... for tracking=local"),
        (
            "tracking.uri=file:///tmp/my runs",
            "tracking.uri='file:///tmp/my runs': this MLflow no longer writes file stores; give "
            "'tracking.uri=sqlite:////tmp/my runs/mlflow.db' (`mlflow migrate-filestore` moves an existing one "
            "there), or set MLFLOW_ALLOW_FILE_STORE=true",
        ),
        ("decode.online_budget=maybe", "decode.online_budget='maybe' must be true or false"),
        (
            "decode.online_budget=true decode.protocol=two_phase",
            "decode.online_budget=true needs decode.protocol=grid (two phases decode one chosen budget)",
        ),
        ("seed=-1", "seed=-1 must be an integer >= 0"),
        ("probe.crop_tokens=16", "probe.crop_tokens=16 must be smaller than probe.prefill_tokens=16"),
        ("decode.max_new_tokens=0", "decode.max_new_tokens=0 must be an integer >= 1"),
        ("host.workdir=relative/dir", "host.workdir='relative/dir' must be an absolute path"),
        ("experiment.name=nope", "experiment.name='nope' is not one of: ddtree_gdn, node_cost, probe"),
        ("decode.tree_budgets=[16,0]", "decode.tree_budgets=[16, 0] must be a non-empty list of positive integers"),
        ("decode.block_size=1", "decode.block_size=1 must be an integer >= 2"),
        ("decode.compile=maybe", "decode.compile='maybe' must be true, false or auto"),
        ("attach=xyz", "attach='xyz' must name a run: its MLflow run id, a unique prefix of it (hexadecimal), or last"),
        # superscripts pass `str.isdigit`, and 5,000 digits are past what `int` converts: a crash each, once
        ("experiment.shard='¹/²'", "experiment.shard='¹/²' must be i/n with 0 <= i < n (prompts i, i+n, …), or null"),
        (
            f"experiment.shard={'9' * 5000}/2",
            "experiment.shard='" + "9" * 120 + "… (5002 characters)' must be i/n "
            "with 0 <= i < n (prompts i, i+n, …), or null",
        ),
        ("experiment.shard=3/3", "experiment.shard='3/3' must be i/n with 0 <= i < n (prompts i, i+n, …), or null"),
    ],
)
def test_bad_values_give_one_line_naming_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        composed(override.split(" ") if " decode." in override else [override])
    assert str(err.value) == message
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["host.port=0"], "host.port=0 must be a port number (1-65535) or null"),
        (["host.python=python3"], "host.python='python3' must be the absolute path of the host's Python"),
        (["host.gpus=some"], "host.gpus='some' must be auto, none or a list of GPU indices"),
        (["host.keepalive_s=0"], "host.keepalive_s must be > 0"),
        (["host.keepalive_count_max=0"], "host.keepalive_count_max=0 must be a whole number >= 1"),
        (["host.sync=scp"], "host.sync='scp' is not one of: auto, rsync, tar"),
        (["host.accept_new_host_key=maybe"], "host.accept_new_host_key must be true or false"),
        (["host.user=[a,b]"], "host.user=['a', 'b'] must be null or a user name"),
        (["host.identity_file=true"], "host.identity_file=True must be null or a key file"),
        (["host.proxy_jump={a:1}"], "host.proxy_jump={'a': 1} must be null or a host"),
        (["host.known_hosts=null"], "host.known_hosts=None must be the path of a known_hosts file"),
    ],
)
def test_ssh_host_settings_are_checked(overrides: list[str], message: str) -> None:
    assert composed(["host=kpro5"])["host"]["kind"] == "ssh"
    with pytest.raises(ConfigError) as err:
        composed(["host=kpro5", *overrides])
    assert str(err.value) == message


def test_the_ssh_settings_are_typed_once_and_a_local_host_has_none() -> None:
    host = JobConfig.from_resolved(composed(["host=kpro5", "host.port=2222", "host.keepalive_s=2"])).host
    assert host.ssh == SSHSettings(
        hostname="kpro5",
        port=2222,
        user="root",
        identity_file=None,
        proxy_jump=None,
        known_hosts="~/.ssh/known_hosts",
        accept_new_host_key=False,
        connect_timeout_s=15.0,
        keepalive_s=2.0,
        keepalive_count_max=3,
    )
    assert host.is_ssh and host.address == "kpro5"
    local = JobConfig.from_resolved(composed([])).host
    assert local.ssh is None and not local.is_ssh and local.address == "local"


def test_missing_mandatory_value_is_named() -> None:
    with pytest.raises(ConfigError, match=r"^model\.arch"):
        composed(["model.arch=???"])


def test_worker_and_orchestrator_agree_on_experiment_names() -> None:
    assert set(EXPERIMENT_NAMES) == set(EXPERIMENTS)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("model=tiny_hybird", f"config error: model='tiny_hybird' is not one of: {MODELS}"),
        (
            "model.dtype=float17",
            "config error: model.dtype='float17' is not one of: float32, float64, bfloat16, float16",
        ),
    ],
)
def test_cli_rejects_bad_config_before_creating_anything(tmp_path: Path, override: str, expected: str) -> None:
    store = tmp_path / "mlruns.db"
    result = run_orchestrator(
        [override, f"tracking.uri=sqlite:///{store}", f"host.workdir={tmp_path / 'work'}"], cwd=tmp_path, timeout=60
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [expected]
    assert not store.exists(), "no MLflow store (and so no run) may be created for a bad config"
    assert not (tmp_path / "work").exists(), "nothing may be created on the host for a bad config"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["decode.temprature=0.5"], "decode.temprature is not a config key; did you mean decode.temperature?"),
        (["hostt.workdir=/x"], "hostt.workdir is not a config key; did you mean host.workdir?"),
        (
            ["-m", "decode.temperature=0,1", "decode.tree_budgetz=[8]"],
            "decode.tree_budgetz is not a config key; did you mean decode.tree_budgets?",
        ),
        (["host=kpro5", "host.keepalive=3"], "host.keepalive is not a config key; did you mean host.keepalive_s?"),
        (["zzz=1"], "zzz is not a config key"),
        (  # Hydra's own report of an unreadable override is a page with a caret under the character
            ["seed=1", "experiment.shard=¹/²"],
            "'experiment.shard=¹/²' is not an override Hydra can read: quote the value for Hydra, as in "
            "\"experiment.shard='¹/²'\"",
        ),
    ],
)
def test_an_unknown_key_is_one_line_with_the_closest_key(args: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        check_group_choices(args, CONF_DIR)
    assert str(err.value) == message


def test_known_and_added_keys_pass() -> None:
    check_group_choices(["host=kpro5", "host.port=2222", "+decode.extra=1", "hydra.verbose=true"], CONF_DIR)
    check_group_choices(["model=tiny_hybrid", "model.config.vocab_size=300", "decode.temperature=0.5"], CONF_DIR)
    # a key of a swept group's choices is known (tiny_trained, the default model, has no model.config keys)
    check_group_choices(["-m", "model=tiny_hybrid,tiny_dense", "model.config.hidden_size=128"], CONF_DIR)
    check_group_choices(["-m", "sweep=default", "decode.block_size=2,4"], CONF_DIR)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("decode.temperature=nan", "decode.temperature=nan must be a finite number >= 0"),
        ("decode.temperature=inf", "decode.temperature=inf must be a finite number >= 0"),
        ("seed=18446744073709551616", "seed=18446744073709551616 must be below 2**64 (a 64-bit seed)"),
    ],
)
def test_non_finite_temperatures_and_huge_seeds_are_rejected(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        composed([override])
    assert str(err.value) == message


def test_a_typo_stops_the_cli_with_exit_2_and_no_run(tmp_path: Path) -> None:
    store = tmp_path / "mlruns.db"
    result = run_orchestrator(["decode.temprature=0.5", f"tracking.uri=sqlite:///{store}"], cwd=tmp_path, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "config error: decode.temprature is not a config key; did you mean decode.temperature?"
    ]
    assert not store.exists()


def test_a_host_names_its_own_default_model_and_the_command_line_still_wins() -> None:
    assert composed(["host=kpro5"])["model"]["name"] == "qwen3_6_27b"
    assert composed(["host=kpro5", "model=tiny_dense"])["model"]["name"] == "tiny_dense"
    assert composed([])["model"]["name"] == "tiny_trained"  # make run: the local host, the embedded pair


def test_the_readmes_config_error_examples_are_what_the_command_prints() -> None:
    """Every `$ python -m orchestrator <override>` followed by a `config error:` line in the README is checked
    against the real message, so the manual cannot drift from the code (a new model, a reworded line)."""
    lines = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8").splitlines()
    examples = [
        (lines[i].split("python -m orchestrator ", 1)[1].split(), lines[i + 1].strip())
        for i in range(len(lines) - 1)
        if lines[i].strip().startswith("$ python -m orchestrator ") and lines[i + 1].strip().startswith("config error:")
    ]
    assert len(examples) >= 4
    for overrides, written in examples:
        with pytest.raises(ConfigError) as err:
            check_group_choices(overrides, CONF_DIR)
            composed(overrides)
        assert f"config error: {err.value}" == written, overrides
