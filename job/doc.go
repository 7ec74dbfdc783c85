// Package job defines the job spec: everything that decides what a training run computes, written
// out in full (docs/design.md, "Jobs"). Two runs of the same spec on the same
// backend produce the same parameters, however they are split across peers.
//
// job is pure data and validation: no network, no database; coordinator, worker and the local
// trainer all read the same type.
package job
