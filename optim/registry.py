"""The registered optimizers: a name -> spec class map (`optim.spec`).

Building one from the ``optimizer`` config block is `optim.build`. Adding an optimizer is its file
in `optim/` and one line here; what it needs (extra update arguments, replicas, the run's length, a
layout check) its spec declares.
"""

from __future__ import annotations

from optim import spec
from optim.adamuon import AdaMuon
from optim.adamw import AdamW
from optim.auon import Auon
from optim.came import Came
from optim.conda import Conda
from optim.cosmos import Cosmos
from optim.demo import DeMo
from optim.des_loc import DESLOC
from optim.diloco import DiLoCo, StreamingDiLoCo
from optim.dion import Dion
from optim.dion2 import Dion2
from optim.drop_muon import DropMuon
from optim.frugal import Frugal, FrugalBlock
from optim.hyperball import AdamHyperball, MuonHyperball
from optim.kl_shampoo import KLShampoo
from optim.learned.mlp_lopt import LOpt
from optim.lion import Lion
from optim.mars_muon import MarsMuon
from optim.mt_dao import MTDAO
from optim.micro_adam import MicroAdam
from optim.muon import Muon
from optim.muon_clip import MuonClip
from optim.noloco import NoLoCo
from optim.normuon import NorMuon
from optim.powersgd import PowerSGD
from optim.psgd_kron import PsgdKron
from optim.scion import Scion
from optim.sgd import SGD
from optim.shampoo import Shampoo
from optim.soap import Soap
from optim.soap_muon import SoapMuon
from optim.speedrun_muon import SpeedrunMuon

OPTIMIZERS: dict[str, type[spec.Spec]] = {
    "adamw": AdamW,
    "sgd": SGD,
    "muon": Muon,
    "normuon": NorMuon,
    "muon_clip": MuonClip,
    "mars_muon": MarsMuon,
    "lion": Lion,
    "came": Came,
    "shampoo": Shampoo,
    "soap": Soap,
    "demo": DeMo,
    "diloco": DiLoCo,
    "streaming_diloco": StreamingDiLoCo,
    "powersgd": PowerSGD,
    "lopt": LOpt,
    "adamuon": AdaMuon,
    "scion": Scion,
    "muon_hyperball": MuonHyperball,
    "adam_hyperball": AdamHyperball,
    "psgd_kron": PsgdKron,
    "kl_shampoo": KLShampoo,
    "cosmos": Cosmos,
    "conda": Conda,
    "dion": Dion,
    "dion2": Dion2,
    "micro_adam": MicroAdam,
    "frugal": Frugal,
    "noloco": NoLoCo,
    "des_loc": DESLOC,
    "frugal_block": FrugalBlock,
    "drop_muon": DropMuon,
    "auon": Auon,
    "soap_muon": SoapMuon,
    "mt_dao": MTDAO,
    "speedrun_muon": SpeedrunMuon,
}


def spec_class(name: str) -> type[spec.Spec]:
    """The spec class registered as ``name``; a ValueError listing the names otherwise."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; set optimizer.name to one of {', '.join(sorted(OPTIMIZERS))}")
    return OPTIMIZERS[name]
