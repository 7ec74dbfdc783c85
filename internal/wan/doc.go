// Package wan is "a WAN on one machine" (issue 17, item 4): a simulated network, on pion's vnet,
// whose hosts reach each other over links of a given rate, round-trip time and loss, for
// clusters that run in one process. A worker is handed a host (client.WorkerConfig.Network), and
// its WebRTC connections — ICE, DTLS, SCTP, the activations they carry — run over the simulation
// instead of the host's sockets: nothing leaves the process, so a test can take a 200 Mb/s, 50 ms
// link between two stages on a laptop, and no real address is ever a target.
//
// # What it models
//
// One router joins every host. A packet from one host to another waits RTT/2 in the router (so a
// round trip takes RTT), and then passes the receiving host's ingress: a token bucket of
// Link.RateBitsPerS in front of a drop-tail queue of Link.QueueBytes. So each host's download is
// its bottleneck — the boundary of a pipeline carries activations one way and gradients the other,
// each bottlenecked at its receiver, as an asymmetric home link would do with symmetric rates.
// With Link.Loss > 0 a fraction of the packets crossing the router is dropped, by a generator of a
// fixed seed, so that a run's losses repeat.
//
// # What it does not
//
//   - No jitter and no reordering: every packet waits exactly RTT/2, in order. (vnet's router
//     can jitter, but it does so by sleeping in its one goroutine, which would delay every
//     host's packets at once; nothing here uses it.)
//   - Upload is not limited: a host sends as fast as it writes, and its traffic queues at the
//     receiver. Two senders to one receiver share that receiver's rate.
//   - The rate counts UDP payload bytes (vnet's token bucket does), not IP and UDP headers: a
//     real 200 Mb/s link carries about 2% less application data.
//   - Only what goes through the vnet is shaped: the WebRTC data plane. The coordinator's
//     WebSocket (control, signaling, the relay) and checkpoint HTTP stay on the real loopback,
//     unshaped — so a job through the relay is not slowed, and the coordinator is never a
//     bottleneck in this simulation.
//   - The simulation runs on the CPUs it measures: the router and each ingress are goroutines
//     that move every packet through channels and timers. Bare UDP crosses it at 2–3 Gb/s on a
//     2-core machine, so vnet itself is not the limit; pion's DTLS and SCTP are (about 1.2 ms of
//     CPU per 64 KiB frame, both ends): one data channel moved 340 Mb/s over the simulation
//     unshaped and 330–460 Mb/s on the real loopback there (TestDataChannelOverWAN,
//     client's BenchmarkRTCThroughput). On a busy machine a 200 Mb/s link is partly CPU-bound.
//   - vnet's sockets queue 1024 packets and drop the rest, so an unshaped link can overflow its
//     receiver, and SCTP then waits out its one-second retransmission timeout; a shaped link
//     paces delivery and its drops happen in the queue instead, as on a real path.
//   - One SCTP association reaches a 200 Mb/s, 50 ms link's rate only after slow start (about
//     8 round trips): 40 MiB took 2.3 s (146 Mb/s on average) with the default queue of one
//     bandwidth-delay product and with 4 MiB alike, 4.0 s with half a product, and 2.6 s with
//     pion's default 1 MiB receive window instead of the worker's 4 MiB.
//
// For real worker processes, scripts/bench_wan_tc.sh shapes the loopback of a network namespace
// with tc's token bucket instead: the rate, but no delay (the kernel has no netem there).
package wan
