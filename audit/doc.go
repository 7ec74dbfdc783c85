// Package audit is Shoal's verification of volunteered work (docs/design.md, "Verification and credit"): the digests a
// worker commits to, the evidence bundle it uploads when one of its steps is audited, and the
// comparison of that evidence with an independent recomputation.
//
// The protocol, in one place:
//
//  1. Every training step's report carries a proto.Commit: the digest of the state the shard
//     started from (StateDigest over its parameters and Adam's moments), and a TensorDigest of
//     every tensor it received and sent. The coordinator checks at once that what one worker says
//     it sent is what the other says it received (a disagreement is a broken or lying link).
//  2. After the next report (whose State commits to the update this step applied), the
//     coordinator draws, with its own randomness, which shards of the step to audit, and asks
//     each for its Bundle: the start state, every tensor received and sent, and the end state —
//     thin (thin.go): the large Adam moments and end tensors only in the groups a seed draws,
//     BLAKE3 chaining values for the rest; and where it recomputes bit for bit, lean: without
//     the end state and the tensors sent.
//  3. Check binds the bundle to the commitments; a Recomputer (client.Recompute, on the
//     coordinator's spare cores) runs the shard's step again from the bundle's start state and
//     inputs; Compare decides: bit for bit when both sides compute with the same kernels, within
//     the stated tolerances across backends.
//
// Because every input is checked against its sender's commitment, a recomputation blames only
// the shard that computed wrongly: an honest neighbour fed bad tensors passes its own audit.
//
// The state digests chain: each report's State is the end of the shard's step before and the
// start of its step after, so a shard's states within a plan are linked by committed steps. The
// coordinator ties the chain's ends to states it knows (coordinator/custody.go): the first
// commitment under a plan must be the state it handed out (the restored checkpoint's tensors or
// the seed's initial weights), and the last step before a checkpoint is checked against that
// checkpoint's shard. A step computed falsely is seen only by an audit of that step, or, where
// replicas hold the same state, by their commitments disagreeing.
//
// Outer mode (sync mode "outer") exchanges pseudo-gradients between replicas peer to peer, outside
// any step's commitments; there the sender signs what it sends, so that a receiver's refusal comes
// with proof the coordinator can check on its own (outer.go, "Outer commitments"). A replica's
// inner steps chain and are audited as above; across an outer step, which changes the parameters
// between two steps, the next report commits to the tensor digests of the state before and after
// and of the global θ (proto.OuterBoundary), from which ComposeState gives the state digests
// again (coordinator/outeraudit.go).
//
// audit imports no network or database package: the coordinator and the worker both use it.
package audit
