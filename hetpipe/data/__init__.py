"""A job's data: data sets, the minibatches each virtual worker reads, and evaluation.

- :mod:`hetpipe.data.builtin`: ``digits``, ``synthetic`` and ``tensors``;
- :mod:`hetpipe.data.source`: ``data.name`` (builtin, ``hetpipe.data`` entry point or
  ``"package.module:function"``) to a :class:`DataSource` of ``torch.utils.data`` data
  sets, and the batch contract ``(inputs, target)`` the first stage takes;
- :mod:`hetpipe.data.stream`: each VW's disjoint, seeded, resumable share of every epoch,
  read through a ``DataLoader``;
- :mod:`hetpipe.data.evaluate`: accuracy on the validation set, batch-norm recalibration;
- :mod:`hetpipe.data.check`: one sample through the model at submit.

Every order here is a pure function of the job's seed, so every process of a job (each
first stage, the head) makes the same one on its own and no data travels between them.
"""

from hetpipe.data.builtin import (
    _LOADERS,
    DataError,
    Dataset,
    TensorPairs,
    _digits_arrays,
    load_dataset,
)
from hetpipe.data.evaluate import call_model, evaluate, recalibrate_bn
from hetpipe.data.source import (
    ENTRY_POINTS,
    Batch,
    Batcher,
    DataSource,
    as_batch,
    first_batch,
    load_data,
    rows_of,
    to_device,
)
from hetpipe.data.stream import MinibatchStream, Reader

__all__ = [
    "ENTRY_POINTS",
    "_LOADERS",
    "Batch",
    "Batcher",
    "DataError",
    "DataSource",
    "Dataset",
    "MinibatchStream",
    "Reader",
    "TensorPairs",
    "_digits_arrays",
    "as_batch",
    "call_model",
    "evaluate",
    "first_batch",
    "load_data",
    "load_dataset",
    "recalibrate_bn",
    "rows_of",
    "to_device",
]
