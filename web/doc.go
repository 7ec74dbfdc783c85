// Package web holds the pages Shoal serves to browsers, embedded into the binary with go:embed so
// that running it needs no build step and no files beside it: the contributor page (Contrib,
// served at / to anyone), the admin dashboard (Admin, served under /admin/ after the admin check)
// and its sign-in form (LoginPage). The browser worker the contributor page loads on Start
// (shoal.wasm, built from wasm/worker) is not embedded: it is built from this module after the
// binary, so the coordinator serves it from a directory (coordinator.Config.WasmDir).
//
// The assets are plain HTML, CSS and ES2020 JavaScript: no framework, no bundler, and nothing
// loaded from another origin (web_test.go and contrib_test.go check), so AdminCSP and ContribCSP
// can forbid everything else. The dashboard reads the coordinator's JSON API (/api/status,
// /api/steps, /api/stream, /api/checkpoints) and posts its actions there; the contributor page
// reads /api/status and drives the worker through the `shoal` object shoal.wasm defines
// (wasm/worker). Both insert every server string as text, never as markup.
//
// This package imports only the standard library: the coordinator imports it, never the reverse.
package web
