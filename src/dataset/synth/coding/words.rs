//! Word lists and the identifiers made from them.

use crate::random::Rng;

pub(super) const WORDS: &[&str] = &[
    "value",
    "field",
    "model",
    "query",
    "result",
    "index",
    "node",
    "path",
    "config",
    "option",
    "handler",
    "request",
    "response",
    "session",
    "cache",
    "token",
    "parser",
    "buffer",
    "stream",
    "record",
    "entry",
    "column",
    "array",
    "frame",
    "axis",
    "label",
    "name",
    "key",
    "item",
    "count",
    "offset",
    "limit",
    "order",
    "group",
    "filter",
    "mask",
    "shape",
    "dtype",
    "unit",
    "scale",
    "format",
    "style",
    "level",
    "state",
    "error",
    "message",
    "context",
    "target",
    "source",
    "default",
    "object",
    "instance",
    "method",
    "attr",
    "kwargs",
    "args",
    "data",
    "table",
    "schema",
    "widget",
    "form",
    "view",
    "router",
    "backend",
    "engine",
    "writer",
    "reader",
    "loader",
    "builder",
    "visitor",
    "printer",
    "expr",
    "symbol",
    "matrix",
    "vector",
    "point",
    "line",
    "figure",
    "legend",
    "color",
    "marker",
    "tick",
    "grid",
    "estimator",
    "params",
    "score",
    "sample",
    "weight",
    "feature",
    "transform",
    "pipeline",
    "fixture",
    "plugin",
    "hook",
    "report",
    "collector",
    "module",
    "package",
    "directive",
    "domain",
    "role",
];

pub(super) const VERBS: &[&str] = &[
    "get",
    "set",
    "build",
    "parse",
    "check",
    "validate",
    "resolve",
    "render",
    "apply",
    "update",
    "compute",
    "load",
    "save",
    "format",
    "convert",
    "normalize",
    "merge",
    "split",
    "find",
    "register",
    "prepare",
    "handle",
    "process",
    "collect",
    "iter",
    "make",
    "create",
    "clean",
];

pub(super) const SUBPACKAGES: &[&str] = &[
    "core",
    "utils",
    "models",
    "fields",
    "forms",
    "admin",
    "checks",
    "io",
    "backends",
    "parsers",
    "printing",
    "contrib",
    "base",
    "internals",
    "plotting",
    "transforms",
    "metrics",
    "compat",
    "config",
    "writers",
    "readers",
    "nodes",
    "testing",
    "ext",
    "domains",
    "api",
];

pub(super) fn snake(rng: &mut Rng, parts: usize) -> String {
    let mut s = String::new();
    for i in 0..parts {
        if i > 0 {
            s.push('_');
        }
        s.push_str(rng.pick::<&str>(WORDS));
    }
    s
}

pub(super) fn camel(rng: &mut Rng) -> String {
    let mut s = String::new();
    for _ in 0..rng.int(1, 3) {
        let w = rng.pick(WORDS);
        let mut chars = w.chars();
        if let Some(c) = chars.next() {
            s.push(c.to_ascii_uppercase());
            s.push_str(chars.as_str());
        }
    }
    s
}

pub(super) fn func_name(rng: &mut Rng) -> String {
    let verb = *rng.pick(VERBS);
    let parts = rng.int(1, 2);
    format!("{verb}_{}", snake(rng, parts))
}
