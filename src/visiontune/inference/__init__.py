"""inference: a trained model loaded once, and what is done with it -- predict, evaluate, TTA, export, serve.

Owns: reading a run folder or a self-describing model file back into a model and its
preprocessing (``loaded``), and the commands that use it. May import training (the shared
forward pass), runs, reports, data, cluster, settings, models and the foundation.
"""

# What ``visiontune export --format`` writes, name: what it is. The command's dispatch, its --help (and the
# top-level one) and the refusal of another name all read this table, so the help lists every format there is.
EXPORT_FORMATS = {
    "onnx": "ONNX",
    "openvino": "OpenVINO IR .xml/.bin",
    "pt2": "a torch.export .pt2 archive (TorchScript's successor)",
    "hub": "a timm Hub folder",
}
