"""Read back what `pipeline deploy render` writes: the Slurm script and the YAML stream."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from pipeline.config import PipelineConfig, load_config
from pipeline.config.schema import ROLES

REPO = Path(__file__).resolve().parents[2]
PROFILES = sorted((REPO / "profiles").glob("*.toml"))


def used_pools(config: PipelineConfig) -> set[str]:
    return {config.services[r].pool for r in ROLES if config.replicas(r) > 0}


@dataclass
class Srun:
    group: int
    role: str
    replica: int
    nproc: int
    words: list[str]

    def option(self, name: str) -> str | None:
        for i, word in enumerate(self.words):
            if word == name:
                return self.words[i + 1]
            if word.startswith(name + "="):
                return word.split("=", 1)[1]
        return None


@dataclass
class SlurmJob:
    text: str
    components: list[dict[str, str]]
    sruns: list[Srun]
    overrides: dict[str, str]
    host_groups: dict[str, int] = field(default_factory=dict)
    # plain NAME=value assignments of the script
    variables: dict[str, str] = field(default_factory=dict)


def parse_slurm(text: str) -> SlurmJob:
    components: list[dict[str, str]] = [{}]
    sruns: list[Srun] = []
    overrides: dict[str, str] = {}
    lines = text.splitlines()
    for line in lines:
        if line.startswith("#SBATCH"):
            option = line.split(None, 1)[1]
            if option == "hetjob":
                components.append({})
            else:
                key, _, value = option.partition("=")
                components[-1][key] = value
        elif line.startswith("srun "):
            assert line.endswith(" &"), line
            words = shlex.split(line[: -len(" &")])
            group = next((int(w.split("=")[1]) for w in words if w.startswith("--het-group=")), 0)
            if "torchrun" in words:
                role = words[words.index("-m") + 1].removeprefix("services.")
                nproc = int(
                    next(w for w in words if w.startswith("--nproc-per-node=")).split("=")[1]
                )
            else:
                start = words.index("pipeline")
                assert words[start + 1] == "service"
                role, nproc = words[start + 2], 1
            replica = int(words[words.index("--replica") + 1])
            sruns.append(Srun(group, role, replica, nproc, words))
    start = lines.index("OVERRIDES=(")
    end = lines.index(")", start)
    words = shlex.split(" ".join(lines[start + 1 : end]))
    for key, value in zip(words[::2], words[1::2], strict=True):
        overrides[key.removeprefix("--")] = value
    host_groups = {}
    for line in lines:
        match = re.fullmatch(r'HOST_(\d+)=\$\(scontrol show hostnames "\$(\w+)" \| head -1\)', line)
        if match:
            host_groups[f"$HOST_{match[1]}"] = int(match[1])
            assert match[2] in ("SLURM_JOB_NODELIST", f"SLURM_JOB_NODELIST_HET_GROUP_{match[1]}")
    variables = {}
    for line in lines:
        match = re.fullmatch(r"([A-Z_][A-Z0-9_]*)=([^($].*)", line)
        if match:
            variables[match[1]] = shlex.split(match[2])[0]
    return SlurmJob(text, components, sruns, overrides, host_groups, variables)


def slurm_values(overrides: dict[str, str]) -> dict[str, str]:
    """The overrides with the script's shell variables given stand-in values."""
    names = {"$CONTROLLER_HOST": "node-0", "$KEYS_DIR": "keys"}
    out = {}
    for key, value in overrides.items():
        match = re.fullmatch(r"\$HOST_(\d+)", value)
        out[key] = f"node-{match[1]}" if match else names.get(value, value)
    return out


def parse_k8s(text: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(text) if doc is not None]


def command_overrides(command: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """(service arguments, dotted overrides) of a container command."""
    start = command.index("--profile")
    args: dict[str, str] = {}
    overrides: dict[str, str] = {}
    words = command[start:]
    for key, value in zip(words[::2], words[1::2], strict=True):
        name = key.removeprefix("--")
        (overrides if "." in name else args)[name] = value
    return args, overrides


def load(profile: Path | str, overrides: dict[str, str] | None = None) -> PipelineConfig:
    return load_config(profile, overrides or {})
