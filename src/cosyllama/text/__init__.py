"""The text side of the frontend: the tokenizer (:mod:`.tokenizer`), normalization, segmentation and the
prompt conventions (:mod:`.normalize`), Russian numbers (:mod:`.russian`) and the helper process that
normalizes long texts off the server's GIL (:mod:`.worker`)."""
