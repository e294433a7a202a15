"""tensorflow-datasets ``data_source`` path on a tiny builder generated here (nothing downloads)."""

import importlib.util
import sys

import numpy as np
import pytest

from jaxcomp import data

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow_datasets") is None, reason="tensorflow-datasets missing"
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    import tensorflow_datasets as tfds

    class TinyImages(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        VERSION = tfds.core.Version("1.0.0")
        # a one-part module name keeps tfds from resolving the builder's code path as a
        # package resource (which needs the optional importlib_resources backport)
        __module__ = "tiny_images"

        def _info(self):
            return tfds.core.DatasetInfo(
                builder=self,
                features=tfds.features.FeaturesDict(
                    {
                        # Image() would PNG-encode through TensorFlow at write time
                        "image": tfds.features.Tensor(shape=(8, 8, 3), dtype=np.uint8),
                        "label": tfds.features.ClassLabel(num_classes=10),
                        "text": tfds.features.Text(),
                    }
                ),
                disable_shuffling=True,
            )

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples(0, 40), "test": self._generate_examples(1, 8)}

        def _generate_examples(self, seed, n):
            rng = np.random.default_rng(seed)
            for i in range(n):
                image = rng.integers(0, 256, (8, 8, 3)).astype(np.uint8)
                yield i, {"image": image, "label": i % 10, "text": f"line {i} of split {seed}"}

    d = str(tmp_path_factory.mktemp("tfds"))
    builder = TinyImages(data_dir=d, file_format="array_record")
    builder.download_and_prepare()
    return d, builder.name


def test_tfds_images_reads_array_record_without_tensorflow(tiny_dir):
    d, name = tiny_dir
    src = data.tfds_images(name, "train", data_dir=d)
    assert len(src) == 40
    rows = src.__getitems__([0, 13])
    assert rows["x"].shape == (2, 8, 8, 3) and rows["x"].dtype == np.float32
    assert 0.0 <= rows["x"].min() and rows["x"].max() <= 1.0
    np.testing.assert_array_equal(rows["label"], [0, 3])
    norm = data.tfds_images(name, "train", data_dir=d, normalize="cifar").__getitems__([0])
    expected = (rows["x"][0] - np.array(data.CIFAR_MEAN)) / np.array(data.CIFAR_STD)
    np.testing.assert_allclose(norm["x"][0], expected, rtol=1e-5)
    batch, _ = data.Loader(src, 8, seed=0).next(data.LoaderState(0, 0))
    np.testing.assert_array_equal(batch["label"], batch["ids"] % 10)
    assert "tensorflow" not in sys.modules  # read without TensorFlow


def test_tfds_text_windows(tiny_dir):
    d, name = tiny_dir
    src = data.tfds_text(name, "test", data_dir=d, seq_len=8)
    text = b"\n".join(f"line {i} of split 1".encode() for i in range(8))
    np.testing.assert_array_equal(src.arrays["x"][0], np.frombuffer(text[:8], np.uint8))


def test_missing_dataset_is_a_clear_error_and_does_not_download(tmp_path):
    with pytest.raises(ValueError, match="not prepared in"):
        data.tfds_images("cifar10", "train", data_dir=str(tmp_path))
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # nothing downloaded


# --- paper-scale datasets: fake copies in tfds format, the crash, the prepare message ---------


IMAGES, CHARS = 32, 1200  # tests/conftest.py's FAKE_IMAGES, FAKE_CHARS


def test_get_dataset_forwards_a_tfds_name(fake_tfds_dir):
    # was: TypeError: get_dataset() got multiple values for argument 'name'
    src = data.get_dataset("tfds_images", "train", name="cifar10", data_dir=fake_tfds_dir)
    assert len(src) == IMAGES and src.num_classes == 10
    text = data.get_dataset("tfds_text", "test", name="tiny_shakespeare", data_dir=fake_tfds_dir)
    assert text.arrays["x"].shape[1:] == (128,)
    with pytest.raises(ValueError, match="unknown argument"):
        data.get_dataset("digits", "train", name="cifar10")


def test_fake_cifar10_reads_through_the_registered_builder(fake_tfds_dir):
    src = data.tfds_images("cifar10", "train", data_dir=fake_tfds_dir, normalize="cifar")
    rows = src.__getitems__(list(range(len(src))))
    assert rows["x"].shape == (IMAGES, 32, 32, 3) and rows["x"].dtype == np.float32
    np.testing.assert_array_equal(np.sort(rows["label"]), np.sort(np.arange(IMAGES) % 10))
    # class-dependent images: every image is nearer its own class mean than any other's
    means = np.stack([rows["x"][rows["label"] == c].mean(0) for c in range(10)])
    dist = ((rows["x"][:, None] - means[None]) ** 2).sum(axis=(2, 3, 4))
    np.testing.assert_array_equal(dist.argmin(1), rows["label"])
    assert len(data.tfds_images("cifar10", "test", data_dir=fake_tfds_dir)) == IMAGES
    assert "tensorflow" not in sys.modules


def test_fake_text_is_a_slice_of_the_pydoc_corpus_per_split(fake_tfds_dir):
    corpus = data.pydoc_corpus()[0].decode("utf-8", errors="ignore")
    for i, split in enumerate(("train", "validation", "test")):
        src = data.tfds_text(split=split, data_dir=fake_tfds_dir, seq_len=8)  # tiny_shakespeare
        expected = np.frombuffer(corpus[CHARS * i : CHARS * i + 8].encode(), np.uint8)
        np.testing.assert_array_equal(src.arrays["x"][0], expected)


def test_write_fake_tfds_refuses_an_existing_dataset_and_bad_arguments(fake_tfds_dir, tmp_path):
    with pytest.raises(ValueError, match="already exists"):
        data.write_fake_tfds("cifar10", fake_tfds_dir)
    with pytest.raises(ValueError, match="name must be one of"):
        data.write_fake_tfds("imagenet2012", str(tmp_path))
    with pytest.raises(ValueError, match="num_examples"):
        data.write_fake_tfds("mnist", str(tmp_path), num_examples=0)
    with pytest.raises(ValueError, match="num_chars"):
        data.write_fake_tfds("tiny_shakespeare", str(tmp_path), num_chars=1)


@pytest.mark.parametrize("reader", [data.tfds_images, data.tfds_text])
def test_missing_dataset_is_one_line_naming_the_prepare_command(reader, tmp_path):
    name = "cifar10" if reader is data.tfds_images else "tiny_shakespeare"
    with pytest.raises(ValueError) as e:
        reader(name, "train", data_dir=str(tmp_path))
    msg = str(e.value)
    assert "\n" not in msg
    assert f"prepare it with `tfds build {name} --file_format=array_record" in msg
    assert f"--data_dir={tmp_path}`" in msg and "not prepared in" in msg
    assert data.prepare_message(name, "train", str(tmp_path)) in msg


def _copy_with_damaged_shard(fake_tfds_dir, tmp_path, damage):
    import glob
    import shutil

    d = str(tmp_path / "damaged")
    shutil.copytree(fake_tfds_dir, d)
    (shard,) = glob.glob(f"{d}/cifar10/*/cifar10-train.array_record-*")
    with open(shard, "r+b") as f:
        damage(f)
    return d


def test_truncated_shard_is_a_clear_error_when_opened(fake_tfds_dir, tmp_path):
    d = _copy_with_damaged_shard(fake_tfds_dir, tmp_path, lambda f: f.truncate(4096))
    with pytest.raises(ValueError, match="may be damaged: prepare the dataset again"):
        data.tfds_images("cifar10", "train", data_dir=d)
    data.tfds_images("cifar10", "test", data_dir=d)  # the intact split still reads


def test_overwritten_bytes_are_a_clear_error_not_garbage_images(fake_tfds_dir, tmp_path):
    def scribble(f):
        f.seek(2000)
        f.write(b"\xff" * 64)

    d = _copy_with_damaged_shard(fake_tfds_dir, tmp_path, scribble)
    with pytest.raises(ValueError, match="may be damaged"):
        src = data.tfds_images("cifar10", "train", data_dir=d)
        src.__getitems__(list(range(len(src))))
