"""Gradients between backward and the optimizer: buckets, module buffers, and the plan rebuilt from the first step."""
