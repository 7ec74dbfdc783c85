// Package local runs a job in one process: the single-process reference that every distributed
// run must reproduce bit for bit on the same backend, and `shoal train` without workers.
//
// It owns the training loop only — batches from data, the model's step, validation, checkpoints
// and resume — and reports each step through a callback; printing is the caller's business.
package local
