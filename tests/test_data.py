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


def test_a_folders_held_out_images_stay_held_out_when_images_are_added():
    """An image's split depends on its path and the seed only: adding a third more images to every class moves none of the
    images already there from one split to the other, and the held-out share stays near the fraction asked for. A class's
    only image trains, and a class of two has one image in each split, as with the stratified split."""
    from common.data.datasets import keyed_split

    labels = np.repeat(np.arange(3), 100)
    keys = [f"{c}/{i:04d}.png" for c, i in zip(labels, range(300))]
    train, held = keyed_split(keys, labels, 0.2, seed=7)
    assert sorted(np.concatenate([train, held]).tolist()) == list(range(300)) and 0.12 < len(held) / 300 < 0.28
    more_labels = np.concatenate([labels, np.repeat(np.arange(3), 33)])
    more_keys = keys + [f"{c}/new-{i:04d}.png" for c, i in zip(np.repeat(np.arange(3), 33), range(99))]
    train2, held2 = keyed_split(more_keys, more_labels, 0.2, seed=7)
    assert set(held2[held2 < 300].tolist()) == set(held.tolist()) and set(train2[train2 < 300].tolist()) == set(train.tolist())
    assert set(keyed_split(keys, labels, 0.2, seed=8)[1].tolist()) != set(held.tolist())  # another factory seed, another split
    train3, held3 = keyed_split(["a/1", "b/1", "b/2"], np.array([0, 1, 1]), 0.9, seed=0)
    assert train3.tolist()[0] == 0 and len(held3) == 1 and len(train3) == 2
    assert keyed_split(keys, labels, 0.0, seed=7)[1].size == 0
