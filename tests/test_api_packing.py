"""The service's packed soft labels (api.packing, written a batch at a time) hold what the library's
pack holds (fadrm_ray.evaluation.soft_labels.pack_soft_labels): the same rows, columns and metas."""
from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch

from fadrm_ray.config import LabelStorage
from fadrm_ray.evaluation.relabel import AugmentSpec, OnlineSoftLabels, SoftLabeler
from fadrm_ray.evaluation.soft_labels import (PACK_KEY, SoftLabelError, StoredSoftLabels, pack_soft_labels,
                                              precompute_soft_labels)

from api.packing import pack_to_file


def test_the_service_pack_is_the_library_pack(digits, digits_teacher, tmp_path):
    labeler = SoftLabeler.from_paths([digits_teacher[0]], digits)
    idx = torch.cat([digits.train.indices_of_class(c)[:2] for c in range(digits.num_classes)])
    images = digits.train.load(idx)
    spec = AugmentSpec(out_size=8, hflip=digits.hflip)
    folders = [precompute_soft_labels(OnlineSoftLabels(images, labeler, spec, 8, seed), 3, tmp_path / "labels",
                                      LabelStorage(topk=3, epochs=2)) for seed in (0, 1)]
    library = tmp_path / "library.parquet"
    library.write_bytes(pack_soft_labels(folders))
    served = pack_to_file(folders, tmp_path / "served.parquet")
    ours, theirs = pq.read_table(served), pq.read_table(library)
    assert ours.num_rows == theirs.num_rows > 0
    assert ours.schema.metadata[PACK_KEY] == theirs.schema.metadata[PACK_KEY]
    assert ours.equals(theirs.replace_schema_metadata(ours.schema.metadata))
    for seed in (0, 1):
        assert StoredSoftLabels(served, images, seed=seed).epochs == 2
    with pytest.raises(SoftLabelError, match="meta.json missing"):
        pack_to_file([tmp_path], tmp_path / "none.parquet")
