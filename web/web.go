package web

import (
	"bytes"
	"crypto/sha256"
	"embed"
	"encoding/base64"
	"fmt"
	"html/template"
	"io/fs"
	"strings"
)

// adminFiles is the dashboard: index.html, admin.js, admin.css.
//
//go:embed admin
var adminFiles embed.FS

// contribFiles is the contributor page: index.html, contrib.js, contrib.css, worker.js (the
// dedicated worker the browser worker runs in, off the page's thread) and the two halves of the
// bridge that carries the worker's peer connections on the page (rtcbridge.js in the worker,
// rtcpage.js on the page). It is public, and it loads the browser worker (shoal.wasm and wasm_exec.js), which the coordinator serves from a
// directory rather than from here: the wasm is built from this module, after it.
//
//go:embed contrib
var contribFiles embed.FS

// loginSource is the sign-in form, an html/template: it lives outside admin/ because it is shown
// to people who have not signed in, and because it is a template, not a file to serve as is.
//
//go:embed login.html
var loginSource string

var loginTemplate = template.Must(template.New("login.html").Parse(loginSource))

// Admin returns the dashboard's files with index.html at the root. The coordinator serves it,
// behind the admin check, as
//
//	http.StripPrefix("/admin", http.FileServerFS(web.Admin()))
//
// so that /admin/ is index.html and /admin/admin.js the script.
func Admin() fs.FS {
	sub, err := fs.Sub(adminFiles, "admin")
	if err != nil { // "admin" is a valid path: fs.Sub cannot fail on it
		panic(fmt.Sprintf("web: admin assets: %v", err))
	}
	return sub
}

// Contrib returns the contributor page's files with index.html at the root. The coordinator
// serves index.html at / and the rest under /contrib/, so that a join link is just
// http://host/?join=TOKEN.
func Contrib() fs.FS {
	sub, err := fs.Sub(contribFiles, "contrib")
	if err != nil { // "contrib" is a valid path: fs.Sub cannot fail on it
		panic(fmt.Sprintf("web: contributor assets: %v", err))
	}
	return sub
}

// LoginPage renders the sign-in form for GET /admin/login. The form POSTs
// application/x-www-form-urlencoded token=... to /admin/login. errMsg, when not empty, is shown
// above the form as text (html/template escapes it); pass a fixed message of the server's own
// ("wrong token") rather than echoing a query parameter, so that a link cannot put words in the
// page's mouth. Serve it as text/html; charset=utf-8 with Cache-Control: no-store and
// Content-Security-Policy: LoginCSP().
func LoginPage(errMsg string) []byte {
	var b bytes.Buffer
	if err := loginTemplate.Execute(&b, struct{ Error string }{errMsg}); err != nil {
		// The template is fixed and the writer a buffer: only a broken template fails here,
		// and TestLoginPage catches that.
		panic(fmt.Sprintf("web: render login page: %v", err))
	}
	return b.Bytes()
}

// AdminCSP is a Content-Security-Policy the dashboard works under: its script, stylesheet and API
// calls come from its own origin only, and no other site may frame it. The page has no inline
// script or style; admin.js sets sizes through the CSSOM (element.style), which style-src does
// not restrict.
const AdminCSP = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; " +
	"img-src 'self' data:; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"

// ContribCSP is the contributor page's Content-Security-Policy: AdminCSP's, plus
// 'wasm-unsafe-eval', without which the page may not compile shoal.wasm, and worker-src for the
// dedicated worker that runs it (contrib/worker.js, which is served with this policy too).
// connect-src 'self' covers the worker's fetches and its WebSocket to the same host; WebRTC to other peers is not a fetch and is not governed by it.
const ContribCSP = "default-src 'none'; script-src 'self' 'wasm-unsafe-eval'; worker-src 'self'; style-src 'self'; " +
	"connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"

// LoginCSP is the Content-Security-Policy for LoginPage: no script at all, and only the page's
// own inline stylesheet, allowed by its hash (the sign-in page cannot load /admin/admin.css,
// which is behind the sign-in).
func LoginCSP() string {
	return "default-src 'none'; style-src '" + styleHash(loginSource) + "'; img-src data:; " +
		"base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
}

// styleHash is the CSP source expression (sha256-BASE64) of the first <style> element's text in
// page, or "" when there is none.
func styleHash(page string) string {
	_, rest, ok := strings.Cut(page, "<style>")
	if !ok {
		return ""
	}
	css, _, ok := strings.Cut(rest, "</style>")
	if !ok {
		return ""
	}
	sum := sha256.Sum256([]byte(css))
	return "sha256-" + base64.StdEncoding.EncodeToString(sum[:])
}
