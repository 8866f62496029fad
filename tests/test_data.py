import numpy as np
import pytest

from common.data import datasets, synth


@pytest.fixture(scope="module")
def spec():
    return datasets.SyntheticSpec(seed=7, num_factories=4, alpha=0.5, train_size=120)


def test_generator_is_deterministic_by_seed(spec):
    a = datasets.factory_dataset(spec, 1)
    b = datasets.factory_dataset(spec, 1)
    assert np.array_equal(a.images, b.images) and np.array_equal(a.labels, b.labels)
    other = datasets.factory_dataset(datasets.SyntheticSpec(seed=8, num_factories=4, alpha=0.5, train_size=120), 1)
    assert not np.array_equal(a.images, other.images)


def test_images_are_valid_and_varied(spec):
    data = datasets.factory_dataset(spec, 0)
    assert data.images.shape == (120, 1, 64, 64) and data.images.dtype == np.float32
    assert data.images.min() >= 0.0 and data.images.max() <= 1.0
    assert data.images.reshape(120, -1).std(axis=1).min() > 0.01  # no blank images
    assert len(synth.CLASSES) >= 5 and synth.CLASSES[0] == "ok"


def test_every_defect_class_changes_the_image():
    rng = synth.rng_for(0, 99)
    profile = synth.factory_profile(0, 0)
    for label in range(1, len(synth.CLASSES)):
        state = rng.bit_generator.state
        with_defect = synth.render(rng, label, profile)
        rng.bit_generator.state = state
        ok = synth.render(np.random.default_rng(0), 0, profile)
        assert not np.allclose(with_defect, ok)


def test_partitions_follow_their_dirichlet_label_mix():
    spec = datasets.SyntheticSpec(seed=3, num_factories=3, alpha=0.3, train_size=2000)
    mix = datasets.label_mix(spec.seed, spec.num_factories, spec.alpha)
    for i in range(spec.num_factories):
        counts = datasets.factory_dataset(spec, i).class_counts() / spec.train_size
        assert np.abs(counts - mix[i]).max() < 0.05
    # non-IID: the factories' label mixes differ from each other
    assert np.abs(mix[0] - mix[1]).sum() > 0.3


def test_large_alpha_is_close_to_balanced():
    mix = datasets.label_mix(0, 5, alpha=1000.0)
    assert np.allclose(mix, 1 / len(synth.CLASSES), atol=0.03)


def test_factories_differ_in_appearance():
    a, b = synth.factory_profile(0, 0), synth.factory_profile(0, 1)
    assert a != b


def test_test_set_is_balanced_and_distinct_from_training(spec):
    test = datasets.test_dataset(spec, size=120)
    assert (test.class_counts() == 20).all()
    train = datasets.factory_dataset(spec, 0)
    assert not any(np.array_equal(test.images[0], img) for img in train.images)


def test_invalid_inputs_are_rejected(spec):
    with pytest.raises(ValueError, match="factory index"):
        datasets.factory_dataset(spec, 9)
    with pytest.raises(ValueError, match="alpha"):
        datasets.label_mix(0, 3, 0.0)
