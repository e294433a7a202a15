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
    with pytest.raises(ValueError, match="not available in data_dir"):
        data.tfds_images("cifar10", "train", data_dir=str(tmp_path))
