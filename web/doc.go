// Package web holds the pages Shoal serves to browsers, embedded into the binary with go:embed so
// that running it needs no build step and no files beside it: the admin dashboard (Admin, served
// under /admin/ after the admin check) and its sign-in form (LoginPage). The contributor page
// joins them here.
//
// The assets are plain HTML, CSS and ES2020 JavaScript: no framework, no bundler, and nothing
// loaded from another origin (web_test.go checks), so AdminCSP can forbid everything else. The
// dashboard reads the coordinator's JSON API (/api/status, /api/steps, /api/stream,
// /api/checkpoints) and posts its actions there; it inserts every server string as text, never
// as markup.
//
// This package imports only the standard library: the coordinator imports it, never the reverse.
package web
