"""The label convention that data and the losses share: a target of ``IGNORE_INDEX`` is no target.

The data packages write it where a position has nothing to learn (padding, a prompt, the token
after a document's end); the models' losses skip it. -100 is the default ``ignore_index`` of
``torch.nn.functional.cross_entropy`` and the convention of Hugging Face ``transformers``, so
labels made here work with either as they are."""

IGNORE_INDEX = -100
