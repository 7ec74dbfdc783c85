// Package data turns a corpus into training batches: the byte tokenizer, corpora from a text
// file, a directory or a nanoGPT uint16 .bin, the train/validation split, the validation windows
// and the batch of each step.
//
// Determinism is the point: the batch of step s is a function of (seed, s) alone, so any peer, a
// replay after a failure or a resumed run draws exactly the same rows. data imports no network or
// database package; it is compiled into the wasm worker.
package data
