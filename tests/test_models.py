"""The model family and the server optimisers: a pinned pretrained backbone, a federated head, FedAvgM/FedAdam/FedProx."""

from __future__ import annotations

import math
import os
import shutil
import sqlite3
import threading
import warnings
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnxruntime
import pytest
import torch
import torch.nn.functional as F
from opacus.accountants import RDPAccountant
from opacus.accountants.analysis.gdp import eps_from_mu

from client.config import AgentConfig
from client.data import DataRequest
from client.trainer import FactoryTrainer
from common import backbones
from common.backbones import BackboneError, BackboneSpec, FrozenBackbone
from common.data import datasets
from common.features import FeatureCache, FeatureSet, array_keys, features_of
from common.models import PRETRAINED_ARCHITECTURES, build_model, federated_part, load_weights, weights_of
from common.training import TrainConfig, proximal_term, train
from server.export import export_version
from server.optimizers import ServerOptimizer
from server.registry.service import NewVersion, Registry

ARCH = "effnet-lite0"
CONFIG = {"architecture": ARCH, "local-epochs": 1, "batch-size": 16}


def test_pretrained_weights_load_offline_and_a_wrong_hash_is_refused(tmp_path, monkeypatch):
    spec = PRETRAINED_ARCHITECTURES[ARCH]
    assert backbones.file_sha256(backbones.lite0_checkpoint()) == spec.sha256  # the package's file, pinned
    model = build_model(ARCH, 6, seed=0)
    assert [name for name, p in model.named_parameters() if p.requires_grad] == ["head.weight", "head.bias"]
    assert list(weights_of(model)) == ["weight", "bias"]  # only the head travels
    model.train()
    assert not model.backbone.training  # BatchNorm keeps its ImageNet statistics whatever train() says
    tampered = tmp_path / "efficientnet-lite0.pth"
    shutil.copy(backbones.lite0_checkpoint(), tampered)
    with open(tampered, "r+b") as f:
        f.seek(4096)
        f.write(b"\x00" * 16)
    monkeypatch.setattr(backbones, "lite0_checkpoint", lambda: tampered)
    with pytest.raises(BackboneError, match="expected 5793"):
        FrozenBackbone(BackboneSpec("efficientnet-lite0", spec.sha256, 64, (2,)))


def test_grey_images_feed_the_rgb_backbone_as_three_equal_channels():
    model = build_model(ARCH, 6, seed=0).eval()
    grey = torch.rand(2, 1, 64, 64)
    with torch.no_grad():
        assert torch.allclose(model(grey), model(grey.expand(-1, 3, -1, -1)), atol=1e-5)


def test_features_are_centred_on_a_public_pinned_reference_that_recomputes(monkeypatch):
    from common import feature_reference, feature_reference_data
    from common.feature_reference import ReferenceError, compute_all, reference_crops

    spec = PRETRAINED_ARCHITECTURES[ARCH]
    entry = feature_reference_data.CENTRES[spec.backbone_key]
    assert spec.ident.endswith("/centre-" + str(entry["sha256"])[:16])  # the cache key and the manifests name the centre
    recomputed = compute_all()[spec.backbone_key]  # from scikit-image's photographs, as the shipped module says
    backbone = backbones.backbone_for(spec)
    assert np.allclose(recomputed, backbone.centre.numpy(), atol=1e-3)
    with torch.no_grad():  # the reference crops' features are centred at zero; their raw features are not
        crops = torch.from_numpy(reference_crops())
        raw = backbone.raw_features(crops)
        assert torch.allclose(backbone(crops[:4]), raw[:4] - backbone.centre, atol=1e-5)  # forward centres; one pass over all
        assert float((raw - backbone.centre).mean(0).norm()) < 1e-2 * float(raw.mean(0).norm())
    b64 = str(entry["float32_b64"])
    tampered = {**feature_reference_data.CENTRES, spec.backbone_key: {**entry, "float32_b64": b64[:40] + ("A" if b64[40] != "A" else "B") + b64[41:]}}
    monkeypatch.setattr(feature_reference_data, "CENTRES", tampered)
    with pytest.raises(ReferenceError, match="does not match its pinned sha256"):
        FrozenBackbone(spec)
    monkeypatch.setattr(feature_reference_data, "CENTRES", {})
    with pytest.raises(ReferenceError, match="python -m common.feature_reference --write"):
        feature_reference.shipped(spec.backbone_key)


def test_a_version_over_differently_computed_features_is_refused_on_the_line(tmp_path):
    from client.inspection import VerificationError, load_verified

    spec = PRETRAINED_ARCHITECTURES[ARCH]
    weights = weights_of(build_model(ARCH, 6, seed=0))
    np.savez(tmp_path / "w.npz", **weights)
    model_input = {"classes": list(datasets.synth.CLASSES), "image_size": 64, "channels": 1}
    manifest = {"id": "v1", "architecture": ARCH, "model_input": {**model_input, "backbone": {"sha256": spec.sha256, "features": spec.ident}}}
    assert load_verified(tmp_path / "w.npz", manifest) is not None
    uncentred = {**manifest, "model_input": {**model_input, "backbone": {"sha256": spec.sha256, "features": spec.backbone_key}}}
    with pytest.raises(VerificationError, match="not the one pinned"):
        load_verified(tmp_path / "w.npz", uncentred)


def test_a_tampered_feature_cache_is_rebuilt(tmp_path):
    model = build_model(ARCH, 6, seed=0)
    data = datasets.test_dataset(datasets.SyntheticSpec(), 6)
    ident = model.backbone.spec.ident
    cache = FeatureCache(tmp_path / "features.db")
    first = features_of(data, ident, model.encode, cache, array_keys(data.images))
    assert cache.misses == 6 and cache.hits == 0
    again = features_of(data, ident, model.encode, cache, array_keys(data.images))
    assert cache.hits == 6 and np.array_equal(first.images, again.images)
    with sqlite3.connect(tmp_path / "features.db") as db:  # flip bytes of one cached vector
        (key, blob), = db.execute("SELECT image, vector FROM features LIMIT 1").fetchall()
        db.execute("UPDATE features SET vector=? WHERE image=?", (bytes(b ^ 0xFF for b in blob[:8]) + blob[8:], key))
    rebuilt = features_of(data, ident, model.encode, cache, array_keys(data.images))
    assert cache.rebuilt == 1 and np.allclose(rebuilt.images, first.images, atol=2e-2)  # recomputed (one image batch: float rounding)
    other = features_of(data, "another-backbone@0/64px/blocks1", model.encode, cache, array_keys(data.images))  # keyed by backbone too
    assert np.array_equal(other.images, first.images) and cache.misses == 6 + 1 + 6


def test_features_are_extracted_where_the_site_says_and_a_gpu_it_lacks_is_refused_at_start(tmp_path):
    """--feature-device: the CPU extractor is the process's shared backbone; the batch size does not change a feature; a
    GPU this host does not have (or a device that is no device) is refused when the agent's configuration is checked,
    naming the option. (The GPU path itself is checked by bench/gpu_check.py on a GPU machine: same features to 2e-6.)"""
    model = build_model(ARCH, 6, seed=0)
    cpu = backbones.feature_extractor(model.backbone.spec, "cpu")
    assert cpu.backbone is model.backbone and cpu.device.type == "cpu"
    data = datasets.test_dataset(datasets.SyntheticSpec(), 9)
    whole = features_of(data, "by-batch", cpu, None, array_keys(data.images), batch=cpu.batch)
    small = features_of(data, "by-batch", cpu, None, array_keys(data.images), batch=4)
    assert np.allclose(whole.images.astype(np.float32), small.images.astype(np.float32), atol=2e-2)
    assert np.array_equal(whole.images, features_of(data, "by-batch", model.encode, None, array_keys(data.images)).images)
    missing_gpu = f"cuda:{torch.cuda.device_count()}"
    for bad, reason in ((missing_gpu, "GPU"), ("tpu", "not one of"), ("gpu", "not one of")):
        with pytest.raises(ValueError, match=f"--feature-device '{bad}'.*{reason}"):
            AgentConfig(factory_id="f", feature_device=bad).validated()
    assert AgentConfig(factory_id="f", feature_device="auto").validated().feature_device == "auto"


SHARED_WRITER = """
import sys
import numpy as np
from common.features import FeatureCache, cache_path, features_of
from common.data.datasets import ImageDataset
rng = np.random.default_rng(int(sys.argv[1]))
images = rng.random((400, 1, 2, 2), dtype=np.float32)
cache = FeatureCache(cache_path("unused.db"))
for start in range(0, 400, 8):  # many small transactions, interleaved with the other writer's
    part = ImageDataset(images[start:start + 8], np.zeros(8, dtype=np.int64), ("a",))
    features_of(part, "toy", lambda x: x.flatten(1) * 2, cache)
print(cache.misses)
"""


def test_processes_share_one_feature_cache_when_told(tmp_path):
    """FEDFORGE_FEATURE_CACHE: two processes writing one cache at the same time both finish, and every row verifies."""
    import subprocess
    import sys

    env = {**os.environ, "FEDFORGE_FEATURE_CACHE": str(tmp_path / "shared.db")}
    procs = [subprocess.Popen([sys.executable, "-c", SHARED_WRITER, str(seed)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=Path(__file__).resolve().parents[1]) for seed in (1, 2)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outputs]
    assert [int(out.split()[-1]) for out, _ in outputs] == [400, 400]
    cache = FeatureCache(tmp_path / "shared.db")
    with sqlite3.connect(tmp_path / "shared.db") as db:
        keys = [k for (k,) in db.execute("SELECT image FROM features WHERE backbone='toy'")]
    assert len(keys) == 800 and len(cache.lookup("toy", keys)) == 800 and cache.rebuilt == 0


def test_head_only_versions_sign_and_export_to_the_same_predictions(tmp_path):
    registry = Registry.at(tmp_path / "registry", create_key=True)
    model = build_model(ARCH, 6, seed=3).eval()
    weights = weights_of(model)
    v = registry.add_version(NewVersion(run_id="r", server_round=1, parent_id=None, kind="fedavg", architecture=ARCH, weights=weights,
                                        metrics={}, participants=["a"], model_input={"classes": list(datasets.synth.CLASSES), "image_size": 64,
                                                                                       "channels": 1, "backbone": {"sha256": backbones.LITE0_SHA256}}))
    assert v.num_parameters == sum(a.size for a in weights.values()) < 50_000  # the head, not the 4.6M-parameter backbone
    registry.approve(v.id, actor="qa")
    data = datasets.test_dataset(datasets.SyntheticSpec(), 12)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # torch.export's writer warns on a channels-last weight (server.export)
        report = export_version(registry, v.id, tmp_path / "out", test_data=data)
    assert [Path(f).suffix for f in report.files] == [".pt", ".pt2", ".onnx"] and not report.skipped
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.suffix != ".json") == sorted(Path(f).name for f in report.files)
    scripted, program = torch.jit.load(report.files[0]), torch.export.load(report.files[1]).module()
    session = onnxruntime.InferenceSession(report.files[2])  # one self-contained file: no .onnx.data beside it
    x = torch.from_numpy(data.images)
    with torch.no_grad():
        expected = load_weights(build_model(ARCH, 6), registry.load_weights(v.id)).eval()(x)
        for batch in (x, x[:1]):  # any batch size: 12, and 1
            torch.testing.assert_close(scripted(batch), expected[: len(batch)], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(program(batch), expected[: len(batch)], atol=1e-4, rtol=1e-4)
            onnx_logits = torch.from_numpy(session.run(["logits"], {"image": batch.numpy()})[0])
            torch.testing.assert_close(onnx_logits, expected[: len(batch)], atol=1e-3, rtol=1e-3)
    assert report.accuracy == pytest.approx(float((expected.argmax(1).numpy() == data.labels).mean()))


def test_dp_on_the_head_is_accounted_exactly(tmp_path):
    """Opacus privatises only the head (over cached features); the ledger's epsilon is Opacus' own."""
    trainer = FactoryTrainer(AgentConfig(factory_id="dp-head", train_size=50, dp=True, dp_epsilon=4.0, dp_planned_rounds=3,
                                         state_dir=str(tmp_path)))
    weights = weights_of(build_model(ARCH, 6, seed=1))
    eps = []
    for r in (1, 2):
        local = trainer.train(weights, CONFIG, r, run_id="r")
        assert list(local.weights) == ["weight", "bias"] and not np.allclose(local.weights["weight"], weights["weight"])
        eps.append(local.privacy["epsilon-spent"])
        weights = local.weights
    history = trainer.ledger.history()
    assert {rate for _, rate, _ in history} == {1.0}  # 50 images, a batch of 256: every step is full-batch
    # full-batch Gaussian releases compose exactly: mu-GDP with the mus in quadrature, Opacus' dual gives epsilon
    exact = eps_from_mu(mu=math.sqrt(sum(steps / noise**2 for noise, _, steps in history)), delta=1e-5)
    assert 0 < eps[0] < eps[1] <= 4.0 and eps[-1] == pytest.approx(exact, rel=1e-6)
    accountant = RDPAccountant()
    for noise, rate, steps in history:
        for _ in range(steps):
            accountant.step(noise_multiplier=noise, sample_rate=rate)
    assert accountant.get_epsilon(delta=1e-5) > eps[-1]  # Opacus' RDP bound of the same steps is looser
    trainer.close()


def test_fedavgm_and_fedadam_follow_their_papers_on_a_constructed_case():
    w = OrderedDict(a=np.array([1.0, -2.0], np.float32))
    averaged = [OrderedDict(a=np.array([1.5, -2.0], np.float32)), OrderedDict(a=np.array([2.0, -1.0], np.float32))]
    m = ServerOptimizer("fedavgm", lr=1.0, beta1=0.5)
    w1 = m.step(w, averaged[0])  # v = d1 = (0.5, 0)
    np.testing.assert_allclose(w1["a"], [1.5, -2.0])
    w2 = m.step(w1, averaged[1])  # d2 = (0.5, 1); v = 0.5 * v + d2 = (0.75, 1)
    np.testing.assert_allclose(w2["a"], [2.25, -1.0])
    a = ServerOptimizer("fedadam", lr=0.1, beta1=0.9, beta2=0.99, tau=1e-3)
    d = np.array([0.5, 0.0])
    out = a.step(w, averaged[0])
    m1, v1 = 0.1 * d, 0.01 * d**2  # Reddi et al. Alg. 2: m = b1 m + (1-b1) d, v = b2 v + (1-b2) d^2, no bias correction
    np.testing.assert_allclose(out["a"], np.array([1.0, -2.0]) + 0.1 * m1 / (np.sqrt(v1) + 1e-3), rtol=1e-6)
    assert ServerOptimizer("fedavg").step(w, averaged[1])["a"].tolist() == [2.0, -1.0]  # plain FedAvg: the average itself
    state = a.state_arrays()
    resumed = ServerOptimizer("fedadam", lr=0.1, beta1=0.9, beta2=0.99, tau=1e-3)
    resumed.load_state(state)
    np.testing.assert_allclose(resumed.step(out, averaged[1])["a"], a.step(out, averaged[1])["a"])


def test_fedprox_adds_mu_times_the_distance_to_the_global_model_to_the_gradient():
    """Two full-batch SGD steps (lr 1, no momentum, decay or clipping) from the received weights w0 (Li et al. 2020):
    w1 = w0 - grad CE(w0)  (the proximal gradient is zero at the anchor), w2 = w1 - (grad CE(w1) + mu (w1 - w0))."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 3)).astype(np.float16)
    data = FeatureSet(x, np.array([0, 1, 1, 0]), ("a", "b"))
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    w0 = [p.detach().clone() for p in model.parameters()]
    cfg = TrainConfig(epochs=2, batch_size=4, lr=1.0, optimizer="sgd", momentum=0.0, weight_decay=0.0, grad_clip=0.0, warmup_fraction=0.0,
                      proximal_mu=0.5, logit_adjustment=0.0)
    train(model, data, cfg)

    def grad_at(ws: list[torch.Tensor]) -> list[torch.Tensor]:
        probe = torch.nn.Linear(3, 2)
        with torch.no_grad():
            for p, w in zip(probe.parameters(), ws):
                p.copy_(w)
        loss = F.cross_entropy(probe(torch.from_numpy(x.astype(np.float32))), torch.tensor([0, 1, 1, 0]))
        return list(torch.autograd.grad(loss, list(probe.parameters())))

    w1 = [w - g for w, g in zip(w0, grad_at(w0))]
    w2 = [w - (g + 0.5 * (w - a)) for w, g, a in zip(w1, grad_at(w1), w0)]
    for p, expected in zip(model.parameters(), w2):
        torch.testing.assert_close(p.detach(), expected, atol=1e-5, rtol=1e-5)
    assert float(proximal_term(model, w0).detach()) == pytest.approx(sum(float(((p - a) ** 2).sum()) for p, a in zip(model.parameters(), w0)))


def test_logit_adjustment_trains_on_logits_plus_tau_log_of_the_factorys_smoothed_label_prior():
    """One full-batch SGD step (lr 1, nothing else) with logit-adjustment tau (Menon et al. 2021): the gradient of
    CE(logits + tau log prior), the prior being the factory's add-one smoothed label counts; 0 is plain cross-entropy."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(4, 3)).astype(np.float16)
    labels = np.array([0, 1, 1, 1])  # counts (1, 3): smoothed prior (2, 4) / 6
    data = FeatureSet(x, labels, ("a", "b"))
    for tau in (0.0, 1.0, 2.0):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        w0 = [p.detach().clone() for p in model.parameters()]
        train(model, data, TrainConfig(epochs=1, batch_size=4, lr=1.0, optimizer="sgd", momentum=0.0, weight_decay=0.0, grad_clip=0.0,
                                       warmup_fraction=0.0, logit_adjustment=tau))
        probe = torch.nn.Linear(3, 2)
        with torch.no_grad():
            for q, w in zip(probe.parameters(), w0):
                q.copy_(w)
        shift = tau * torch.log(torch.tensor([2.0, 4.0]) / 6.0)
        loss = F.cross_entropy(probe(torch.from_numpy(x.astype(np.float32))) + shift, torch.from_numpy(labels))
        for p, w, g in zip(model.parameters(), w0, torch.autograd.grad(loss, list(probe.parameters()))):
            torch.testing.assert_close(p.detach(), w - g, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="logit-adjustment"):
        TrainConfig(logit_adjustment=-1.0)


def test_pooled_images_train_on_each_groups_own_label_prior():
    """Training on several factories' images pooled (the quality bench's pooled baseline) with ``groups``: one full-batch
    SGD step is the gradient of CE(logits + tau log prior of the image's own factory); one group is the plain adjustment."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(6, 3)).astype(np.float16)
    labels = np.array([0, 0, 1, 1, 1, 0])
    groups = np.array([0, 0, 1, 1, 1, 1])  # factory 0: counts (2, 0), smoothed (3, 1) / 4; factory 1: (1, 3), smoothed (2, 4) / 6
    data = FeatureSet(x, labels, ("a", "b"))
    sgd = TrainConfig(epochs=1, batch_size=6, lr=1.0, optimizer="sgd", momentum=0.0, weight_decay=0.0, grad_clip=0.0, warmup_fraction=0.0,
                      logit_adjustment=1.0)

    def one_step(group_of: np.ndarray | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        train(model, data, sgd, groups=group_of)
        return [p.detach() for p in model.parameters()]

    torch.manual_seed(0)
    probe = torch.nn.Linear(3, 2)
    w0 = [p.detach().clone() for p in probe.parameters()]
    shift = torch.log(torch.tensor([[3.0, 1.0]] * 2 + [[2.0, 4.0]] * 4) / torch.tensor([[4.0]] * 2 + [[6.0]] * 4))
    loss = F.cross_entropy(probe(torch.from_numpy(x.astype(np.float32))) + shift, torch.from_numpy(labels))
    for p, w, g in zip(one_step(groups), w0, torch.autograd.grad(loss, list(probe.parameters()))):
        torch.testing.assert_close(p, w - g, atol=1e-5, rtol=1e-5)
    for a, b in zip(one_step(np.zeros(6, dtype=np.int64)), one_step(None)):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="one group per example"):
        train(torch.nn.Linear(3, 2), data, sgd, groups=groups[:4])


def test_a_logit_adjusted_head_leans_less_to_its_factorys_majority_class():
    """On features where one class holds 90% of a factory's images, the head trained on logits + log(prior) calls the rare
    classes' images the majority class less often on a balanced test set (what the averaged model then inherits)."""
    from tests.conftest import majority_class_features, rare_class_recall

    train_set, test = majority_class_features(seed=2, spread=0.6)  # overlapping classes: where the prior decides
    recall = {}
    for tau in (0.0, 1.0):
        torch.manual_seed(2)
        head = torch.nn.Linear(8, 3)
        train(head, train_set, TrainConfig(epochs=2, logit_adjustment=tau))
        recall[tau] = rare_class_recall(head, test)
    assert recall[1.0] > recall[0.0] + 0.05, recall  # 0.647 vs 0.567 here (no noise: the same every run)


def test_personal_model_of_the_approved_version_is_the_mean_of_a_fine_tune_and_a_head_trained_alone_served_unless_clearly_worse(tmp_path):
    import threading
    from dataclasses import replace

    from client.agent import personal_chooser
    from client.personal import global_clearly_better, weights_digest
    from client.trainer import ALONE_SEED, train_config_from

    trainer = FactoryTrainer(AgentConfig(factory_id="p", train_size=60, alpha=0.1, val_fraction=0.5, state_dir=str(tmp_path)))
    initial = weights_of(build_model(ARCH, 6, seed=0))
    config = {**CONFIG, "local-epochs": 3, "lr": 0.01, "personal-epochs": 5, "local-only-epochs": 8}
    local = trainer.train(initial, config, 1, run_id="r")
    trainer.wait_personal()  # the fine-tune runs beside the round
    personal, record = trainer.personal.get(ARCH)
    assert record.global_accuracy == pytest.approx(local.received.accuracy)
    assert record.accuracy == pytest.approx(trainer.score(ARCH, personal, DataRequest()))

    # what it is: the received global head fine-tuned here, averaged with a head trained from scratch on the same images
    cfg = train_config_from(config, 1)  # the round's options, as the trainer reads them
    train_set = trainer.prepare(initial, config).train_set
    tuned = federated_part(load_weights(build_model(ARCH, 6), initial))
    train(tuned, train_set, cfg.personal())
    alone = federated_part(build_model(ARCH, 6, seed=ALONE_SEED))
    train(alone, train_set, replace(cfg.local_only(), seed=ALONE_SEED))
    for key, value in personal.items():
        expected = (tuned.state_dict()[key].numpy() + alone.state_dict()[key].numpy()) / 2
        np.testing.assert_allclose(value, expected, atol=1e-5)
    assert not np.allclose(personal["weight"], local.weights["weight"])  # not the update that was sent
    fine_tune_only = trainer.personal_head(trainer.prepare(initial, config), initial, train_config_from({**config, "local-only-epochs": 0}, 1))
    np.testing.assert_allclose(fine_tune_only.weight.detach().numpy(), tuned.weight.detach().numpy(), atol=1e-5)

    assert record.base_sha256 == weights_digest(initial) and record.settings["personal-epochs"] == 5  # what it was made from

    choose = personal_chooser(trainer, threading.Lock())
    label, served, why = choose("v1", ARCH, DataRequest(), build_model(ARCH, 6, seed=0))  # approved: the model it was made from
    assert label == "personal@v1" and "held-out images" in why
    np.testing.assert_allclose(federated_part(served).weight.detach().numpy(), personal["weight"])

    # another approved version: never the personal model of a global model nobody approved, but one made from this version
    other = load_weights(build_model(ARCH, 6), local.weights)
    label, served, _ = choose("v2", ARCH, DataRequest(), other)
    of_other = trainer.personal_of(ARCH, DataRequest(), local.weights, record.settings)
    clearly = global_clearly_better(trainer.held_out_hits(ARCH, local.weights, DataRequest()), trainer.held_out_hits(ARCH, of_other, DataRequest()))
    if clearly:
        assert label == "v2" and served is other
    else:
        assert label == "personal@v2" and not np.allclose(of_other["weight"], personal["weight"])
        np.testing.assert_allclose(federated_part(served).weight.detach().numpy(), of_other["weight"], atol=1e-6)

    # a personal model that says one class whatever it sees, against an approved model that gets most held-out images right
    held_out = np.asarray(trainer.prepare(initial, config).held_out.labels)
    rarest = int(np.argmin(np.bincount(held_out, minlength=6)))
    constant = OrderedDict((k, np.zeros_like(v)) for k, v in personal.items())
    constant["bias"][rarest] = 10.0
    trainer.personal.offer(ARCH, DataRequest(), constant, 0.0, 0.0, 2, weights_digest(personal), record.settings)
    good = load_weights(build_model(ARCH, 6), personal)
    assert global_clearly_better(trainer.held_out_hits(ARCH, personal, DataRequest()), trainer.held_out_hits(ARCH, constant, DataRequest()))
    label, served, why = choose("v3", ARCH, DataRequest(), good)
    assert label == "v3" and served is good and "clearly better" in why
    trainer.close()


def test_public_examples_are_proxy_images_the_global_model_is_sure_are_of_a_class_rare_here():
    from client.personal import public_examples

    labels = np.array([0] * 95 + [1] * 4 + [2] * 1)  # class 0 common; 1 and 2 rare (under 5%); 3 never seen
    sure, unsure = 4.0, 0.5
    logits = np.array([[sure, 0, 0, 0],  # common here: not taken
                       [0, sure, 0, 0],  # rare here, sure: taken as 1
                       [0, 0, unsure, 0],  # rare here, unsure: not taken
                       [0, 0, 0, sure],  # never seen here, sure: taken as 3
                       [0, 0, sure, sure]])  # split between two classes: p = 0.49, not taken
    chosen, assigned = public_examples(logits, labels, 4, confidence=0.8, rare=0.05)
    assert chosen.tolist() == [1, 3] and assigned.tolist() == [1, 3]
    chosen, _ = public_examples(logits, labels, 4, confidence=0.8, rare=0.0)  # nothing is rare
    assert chosen.tolist() == []
    with pytest.raises(ValueError, match=r"logits on the proxy set must be \(N, 4\)"):
        public_examples(logits[:, :3], labels, 4, confidence=0.8, rare=0.05)


def test_the_personal_fine_tune_also_learns_rare_classes_from_the_runs_public_images(tmp_path):
    """With the run's proxy set the fine-tune trains on the factory's images plus the proxy images the received model labels
    confidently as classes rare here; the personal model of an approved version is made with the same set; without the set,
    or with personal-public-confidence 0, the personal model is what it was before."""
    import threading

    from client.agent import personal_chooser
    from client.personal import public_examples
    from client.trainer import ALONE_SEED, train_config_from
    from common.distill import ProxyCache, ProxySet

    trainer = FactoryTrainer(AgentConfig(factory_id="p", train_size=60, alpha=0.1, val_fraction=0.5, state_dir=str(tmp_path)))
    initial = weights_of(build_model(ARCH, 6, seed=0))
    config = {**CONFIG, "local-epochs": 3, "lr": 0.05, "personal-epochs": 3, "local-only-epochs": 4, "personal-public-confidence": 0.2}
    global_weights = trainer.train(initial, config, 1, run_id="r").weights  # a global model that knows something
    public = ProxySet(datasets.proxy_images(datasets.SyntheticSpec(seed=3), 40))
    prep = trainer.prepare(global_weights, config)
    cfg = train_config_from(config, 1)

    with torch.no_grad():
        received = federated_part(load_weights(build_model(ARCH, 6), global_weights))
        features = trainer._proxy_features(prep, public)
        chosen, assigned = public_examples(received(torch.from_numpy(features)).numpy(), prep.train_set.labels, 6, 0.2, 0.05)
    assert 0 < len(chosen) < len(public) and np.bincount(prep.train_set.labels, minlength=6)[assigned].max() < 0.05 * len(prep.train_set)
    own = prep.train_set
    augmented = FeatureSet(np.concatenate([own.images, features[chosen].astype(own.images.dtype)]), np.concatenate([own.labels, assigned]),
                           own.classes)
    tuned = federated_part(load_weights(build_model(ARCH, 6), global_weights))
    train(tuned, augmented, cfg.personal())
    alone = federated_part(build_model(ARCH, 6, seed=ALONE_SEED))
    train(alone, own, replace(cfg.local_only(), seed=ALONE_SEED))  # the head trained alone learns from the factory's images only
    expected = (tuned.weight.detach().numpy() + alone.weight.detach().numpy()) / 2
    with_public = trainer.personal_head(prep, global_weights, cfg, public)
    np.testing.assert_allclose(with_public.weight.detach().numpy(), expected, atol=1e-5)

    without = trainer.personal_head(prep, global_weights, cfg).weight.detach().numpy()
    assert not np.allclose(without, expected, atol=1e-3)
    switched_off = trainer.personal_head(prep, global_weights, replace(cfg, personal_public_confidence=0.0), public)
    np.testing.assert_allclose(switched_off.weight.detach().numpy(), without, atol=1e-6)

    # inspection's personal model of an approved version learns from the set the round's personal model named
    trainer.personal.offer(ARCH, DataRequest(), weights_of(with_public), 1.0, 0.0, 1, "", cfg.to_run_config() | {"public-proxy-sha256": public.sha256})
    proxies = ProxyCache(tmp_path / "proxy")
    proxies.put(public.sha256, public.images)
    made_with: list[ProxySet | None] = []
    make = trainer.personal_of
    trainer.personal_of = lambda *args: made_with.append(args[-1]) or make(*args)  # type: ignore[method-assign]
    personal_chooser(trainer, threading.Lock(), proxies)("v1", ARCH, DataRequest(), load_weights(build_model(ARCH, 6), global_weights))
    assert [p.sha256 for p in made_with] == [public.sha256]
    settings = cfg.to_run_config()
    assert not np.allclose(make(ARCH, DataRequest(), global_weights, settings, public)["weight"], make(ARCH, DataRequest(), global_weights, settings)["weight"])


def test_the_global_model_is_clearly_better_only_beyond_chance_on_the_images_one_model_gets_right():
    from client.personal import global_clearly_better

    def hits(only_global: int, only_personal: int, both: int = 10) -> tuple[np.ndarray, np.ndarray]:
        g = np.array([True] * only_global + [False] * only_personal + [True] * both)
        return g, np.array([False] * only_global + [True] * only_personal + [True] * both)

    # one-sided exact McNemar: P(X >= b | n = b + c, 1/2) < 0.05
    assert global_clearly_better(*hits(5, 0))  # 1/32
    assert not global_clearly_better(*hits(4, 0))  # 1/16
    assert not global_clearly_better(*hits(6, 1))  # 8/128
    assert global_clearly_better(*hits(7, 1))  # 9/256
    assert not global_clearly_better(*hits(3, 3)) and not global_clearly_better(*hits(0, 9)) and not global_clearly_better(*hits(0, 0))
    with pytest.raises(ValueError, match="different lengths"):
        global_clearly_better(np.ones(3, dtype=bool), np.ones(4, dtype=bool))


def test_cnn_family_still_trains_and_averages_every_weight():
    model = build_model("cnn-small", 6, seed=0, in_channels=3)
    assert len(weights_of(model)) == len(model.state_dict()) and federated_part(model) is model
    data = datasets.ImageDataset(np.random.default_rng(0).random((8, 3, 32, 32), dtype=np.float32), np.arange(8) % 6)
    result = train(model, data, TrainConfig(epochs=1, batch_size=4))
    assert np.isfinite(result.loss) and result.steps == 2
    assert Path(backbones.__file__).name == "backbones.py"


def test_seeded_builds_are_reproducible_while_other_threads_build_models():
    """torch has one global stream per process: an agent's background personal job, its handlers and (in tests and
    simulation) the server build models at once, and a seeded build must not get another thread's numbers."""
    reference = {seed: weights_of(build_model(ARCH, 6, seed=seed)) for seed in range(3)}
    reproduced: dict[int, list[bool]] = {seed: [] for seed in reference}

    def build_again(seed: int) -> None:
        for _ in range(20):
            again = weights_of(build_model(ARCH, 6, seed=seed))
            reproduced[seed].append(all(np.array_equal(again[k], reference[seed][k]) for k in again))

    def build_unseeded() -> None:
        for _ in range(20):
            build_model(ARCH, 6)

    threads = [threading.Thread(target=build_again, args=(seed,)) for seed in reference] + [threading.Thread(target=build_unseeded)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert {seed: sum(ok) for seed, ok in reproduced.items()} == {seed: 20 for seed in reference}
