"""`switchyard epp`: a Gateway API Inference Extension endpoint picker (Envoy ext_proc), deciding with the
router's core."""
