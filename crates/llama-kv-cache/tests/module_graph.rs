//! The module graph of the core crate (`crates/llama-kv-cache/src`) and of the Node binding
//! (`src/`), read from their `mod` and `use` lines and their `crate::` paths, held to one table
//! of layers per crate: a module may import from lower layers and from its own folder, never
//! from a layer above it or sideways into another folder of its layer, and no two files may
//! import each other through any chain. Test modules (`#[cfg(test)]`) are not part of the graph.
//!
//! Paths are resolved to the file that defines the item, through re-exports (`pub use`,
//! globs), so importing a name from a folder's `mod.rs` ties the importer to the file that
//! really holds it.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// The core's layers, bottom first. Each entry names the top-level modules (files or folders
/// under `src/`) of one layer; `""` is the crate root (`lib.rs`).
const CORE_LAYERS: &[(&str, &[&str])] = &[
    ("errors", &["error"]),
    (
        "allocation, element types and cell extensions",
        &["alloc", "ggml_type", "cell_ext"],
    ),
    ("staging memory for payload copies", &["staging"]),
    ("cache parameters", &["params"]),
    ("cells and tensors", &["cells", "tensors"]),
    ("models", &["model"]),
    ("state format", &["state"]),
    ("the unified cache", &["cache"]),
    ("today's memories", &["memory"]),
    ("crate root", &[""]),
];

/// The binding's layers, bottom first.
const BINDING_LAYERS: &[(&str, &[&str])] = &[
    ("errors", &["error"]),
    ("argument conversion", &["args"]),
    ("option conversion", &["options"]),
    ("plain option and result types", &["types"]),
    ("callbacks", &["signal", "move_list", "device"]),
    ("the shared cache handle", &["handle"]),
    ("the release clock", &["decay"]),
    ("scheduling", &["queue"]),
    ("tasks and jobs", &["tasks"]),
    ("jobs", &["jobs"]),
    ("streams", &["state_stream"]),
    ("the cache class", &["kv_cache", "restorer"]),
    ("models and inspection", &["inspect"]),
    ("model set-up", &["model"]),
    ("the prompt store", &["store_backend", "store_events"]),
    ("the prompt store class", &["prompt_store"]),
    ("crate root", &[""]),
];

/// One source file: its module path and what it declares and imports.
struct SourceFile {
    path: PathBuf,
    /// Module path segments (`[]` for the crate root).
    module: Vec<String>,
    /// Child modules it declares (`mod x;`).
    children: BTreeSet<String>,
    /// Names of items it defines.
    defines: BTreeSet<String>,
    /// Paths it re-exports (`pub use`), absolute, with the last segment possibly `*`.
    reexports: Vec<Vec<String>>,
    /// Every path it uses, absolute.
    uses: Vec<Vec<String>>,
}

fn module_of(root: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(root).unwrap();
    let mut parts: Vec<String> = rel
        .iter()
        .map(|s| s.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().unwrap();
    match last.as_str() {
        "lib.rs" | "mod.rs" => {}
        name => parts.push(name.trim_end_matches(".rs").to_string()),
    }
    parts
}

/// The code of a file without comments and without its test module.
fn code_of(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let t = line.trim();
        if t == "#[cfg(test)]"
            && lines
                .peek()
                .is_some_and(|n| n.trim_start().starts_with("mod "))
        {
            break;
        }
        let code = match t.find("//") {
            Some(i) => &t[..i],
            None => t,
        };
        out.push(code.trim().to_string());
    }
    out
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Expands a `use` tree (`a::{b, c::{self, d}}`) into its paths.
fn expand(tree: &str) -> Vec<Vec<String>> {
    let tree = tree.trim();
    let Some(open) = tree.find('{') else {
        let path = tree.split(" as ").next().unwrap().trim();
        return vec![path.split("::").map(|s| s.trim().to_string()).collect()];
    };
    let prefix: Vec<String> = tree[..open]
        .trim_end_matches("::")
        .split("::")
        .filter(|s| !s.is_empty())
        .map(|s| s.trim().to_string())
        .collect();
    let inner = &tree[open + 1..tree.rfind('}').unwrap()];
    let (mut depth, mut start, mut items) = (0, 0, Vec::new());
    for (i, c) in inner.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&inner[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items.push(&inner[start..]);
    let mut out = Vec::new();
    for item in items.into_iter().filter(|s| !s.trim().is_empty()) {
        for sub in expand(item) {
            let mut p = prefix.clone();
            if sub != ["self"] {
                p.extend(sub);
            }
            out.push(p);
        }
    }
    out
}

/// Makes a path absolute: `crate::`, `super::`, `self::` and child modules are resolved;
/// anything else (std, other crates) is `None`.
fn absolute(
    module: &[String],
    children: &BTreeSet<String>,
    path: &[String],
) -> Option<Vec<String>> {
    let first = path.first()?;
    match first.as_str() {
        "crate" => Some(path[1..].to_vec()),
        "self" => Some(module.iter().chain(&path[1..]).cloned().collect()),
        "super" => {
            let mut m = module.to_vec();
            let mut rest = path;
            while rest.first().is_some_and(|s| s == "super") {
                m.pop();
                rest = &rest[1..];
            }
            m.extend(rest.iter().cloned());
            Some(m)
        }
        name if children.contains(name) => Some(module.iter().chain(path).cloned().collect()),
        _ => None,
    }
}

fn read_tree(root: &Path) -> Vec<SourceFile> {
    let mut files = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).unwrap() {
            let p = entry.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|e| e == "rs") {
                files.push(p);
            }
        }
    }
    files.sort();
    files
        .into_iter()
        .map(|path| {
            let module = module_of(root, &path);
            let code = code_of(&fs::read_to_string(&path).unwrap());
            let mut f = SourceFile {
                path,
                module,
                children: BTreeSet::new(),
                defines: BTreeSet::new(),
                reexports: Vec::new(),
                uses: Vec::new(),
            };
            // declarations first: `use x::...` of a child module needs them
            for line in &code {
                let bare = line
                    .trim_start_matches("pub(crate) ")
                    .trim_start_matches("pub(super) ")
                    .trim_start_matches("pub ");
                for kw in [
                    "mod",
                    "fn",
                    "struct",
                    "enum",
                    "trait",
                    "type",
                    "const",
                    "static",
                    "macro_rules!",
                ] {
                    if let Some(rest) = bare.strip_prefix(kw).and_then(|r| r.strip_prefix(' ')) {
                        let name: String = rest.chars().take_while(|&c| is_ident(c)).collect();
                        if kw == "mod" && rest[name.len()..].trim_start().starts_with(';') {
                            f.children.insert(name.clone());
                        }
                        f.defines.insert(name);
                    }
                }
            }
            let joined = code.join("\n");
            let mut statement = String::new();
            let mut in_use = false;
            for line in joined.lines() {
                let bare = line
                    .trim_start_matches("pub(crate) ")
                    .trim_start_matches("pub(super) ")
                    .trim_start_matches("pub ");
                if !in_use && bare.starts_with("use ") {
                    in_use = true;
                    statement.clear();
                }
                if in_use {
                    statement.push_str(line);
                    statement.push(' ');
                    if line.contains(';') {
                        in_use = false;
                        let public = statement.starts_with("pub use")
                            || statement.starts_with("pub(crate) use");
                        let tree = statement
                            [statement.find("use ").unwrap() + 4..statement.find(';').unwrap()]
                            .to_string();
                        for p in expand(&tree) {
                            if let Some(abs) = absolute(&f.module, &f.children, &p) {
                                if let Some(alias) =
                                    tree.split(" as ").nth(1).filter(|_| !tree.contains('{'))
                                {
                                    f.defines.insert(alias.trim().to_string());
                                }
                                if public {
                                    f.reexports.push(abs.clone());
                                }
                                f.uses.push(abs);
                            }
                        }
                    }
                    continue;
                }
                // inline paths: `crate::a::b(...)`
                let mut at = 0;
                while let Some(i) = line[at..].find("crate::") {
                    let start = at + i;
                    let before = line[..start].chars().last();
                    let tail: String = line[start..]
                        .chars()
                        .take_while(|&c| is_ident(c) || c == ':')
                        .collect();
                    at = start + tail.len().max(1);
                    if before.is_some_and(is_ident) {
                        continue;
                    }
                    let p: Vec<String> = tail
                        .trim_end_matches(':')
                        .split("::")
                        .map(String::from)
                        .collect();
                    f.uses.push(p[1..].to_vec());
                }
            }
            f
        })
        .collect()
}

/// Resolves an absolute path to the file that defines its item.
fn resolve(files: &[SourceFile], path: &[String], depth: usize) -> Option<usize> {
    let module_file = |m: &[String]| files.iter().position(|f| f.module == m);
    let (mut k, mut file) = (path.len(), None);
    while file.is_none() {
        file = module_file(&path[..k]);
        if file.is_none() {
            k = k.checked_sub(1)?;
        }
    }
    let file = file?;
    let Some(name) = path.get(k) else {
        return Some(file);
    };
    if files[file].defines.contains(name) || depth > 8 {
        return Some(file);
    }
    for re in &files[file].reexports {
        match re.last().map(String::as_str) {
            Some("*") => {
                let mut p = re[..re.len() - 1].to_vec();
                p.extend(path[k..].iter().cloned());
                let target = resolve(files, &p, depth + 1);
                if let Some(t) = target.filter(|&t| files[t].defines.contains(name)) {
                    return Some(t);
                }
            }
            Some(last) if last == name => return resolve(files, re, depth + 1),
            _ => {}
        }
    }
    Some(file)
}

fn layer_of(layers: &[(&str, &[&str])], module: &[String]) -> Option<usize> {
    let top = module.first().map_or("", String::as_str);
    layers.iter().position(|(_, mods)| mods.contains(&top))
}

/// Every violation of the table and every cycle in the tree at `root`.
fn check(root: &Path, layers: &[(&str, &[&str])]) -> Vec<String> {
    let files = read_tree(root);
    let name = |i: usize| {
        files[i]
            .path
            .strip_prefix(root)
            .unwrap()
            .display()
            .to_string()
    };
    let mut problems = Vec::new();
    let mut edges: BTreeMap<usize, BTreeSet<usize>> = BTreeMap::new();
    for (i, f) in files.iter().enumerate() {
        let Some(from_layer) = layer_of(layers, &f.module) else {
            problems.push(format!("{}: module is in no layer of the table", name(i)));
            continue;
        };
        for p in &f.uses {
            let Some(j) = resolve(&files, p, 0) else {
                continue;
            };
            if j == i {
                continue;
            }
            edges.entry(i).or_default().insert(j);
            let to = &files[j].module;
            let Some(to_layer) = layer_of(layers, to) else {
                continue;
            };
            let sideways = to_layer == from_layer && to.first() != f.module.first();
            if to_layer > from_layer || sideways {
                problems.push(format!(
                    "{} (layer '{}') imports {} from {} (layer '{}')",
                    name(i),
                    layers[from_layer].0,
                    p.join("::"),
                    name(j),
                    layers[to_layer].0
                ));
            }
        }
    }
    // cycles: a file that reaches itself
    for start in 0..files.len() {
        let mut seen = BTreeSet::new();
        let mut stack: Vec<(usize, Vec<usize>)> = vec![(start, vec![start])];
        while let Some((at, trail)) = stack.pop() {
            for &next in edges.get(&at).into_iter().flatten() {
                if next == start {
                    let mut names: Vec<String> = trail.iter().map(|&k| name(k)).collect();
                    names.push(name(start));
                    problems.push(format!("cycle: {}", names.join(" -> ")));
                    break;
                }
                if seen.insert(next) {
                    let mut t = trail.clone();
                    t.push(next);
                    stack.push((next, t));
                }
            }
        }
    }
    problems.sort();
    problems.dedup();
    problems
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn the_core_imports_only_from_lower_layers_and_has_no_cycle() {
    let problems = check(&workspace().join("crates/llama-kv-cache/src"), CORE_LAYERS);
    assert!(problems.is_empty(), "\n{}", problems.join("\n"));
}

#[test]
fn the_binding_imports_only_from_lower_layers_and_has_no_cycle() {
    let problems = check(&workspace().join("src"), BINDING_LAYERS);
    assert!(problems.is_empty(), "\n{}", problems.join("\n"));
}

#[test]
fn the_graph_reader_sees_an_upward_import_and_a_cycle() {
    let dir = std::env::temp_dir().join(format!("module-graph-{}", std::process::id()));
    let src = dir.join("src");
    fs::create_dir_all(src.join("low")).unwrap();
    fs::write(src.join("lib.rs"), "mod low;\nmod high;\n").unwrap();
    fs::write(src.join("low/mod.rs"), "mod a;\nmod b;\npub use a::*;\n").unwrap();
    fs::write(
        src.join("low/a.rs"),
        "use crate::high::Top;\nuse super::b::B;\npub struct A;\n",
    )
    .unwrap();
    fs::write(src.join("low/b.rs"), "pub struct B(crate::low::A);\n").unwrap();
    fs::write(
        src.join("high.rs"),
        "use crate::low::A;\npub struct Top(A);\n",
    )
    .unwrap();
    let layers: &[(&str, &[&str])] = &[("low", &["low"]), ("high", &["high"]), ("root", &[""])];
    let problems = check(&src, layers);
    fs::remove_dir_all(&dir).unwrap();
    assert!(
        problems
            .iter()
            .any(|p| p.starts_with("low/a.rs (layer 'low') imports high::Top")),
        "{problems:?}"
    );
    // b reaches A through the folder's glob re-export: a -> b -> a
    assert!(
        problems
            .iter()
            .any(|p| p == "cycle: low/a.rs -> low/b.rs -> low/a.rs"),
        "{problems:?}"
    );
}

/// The live memories' own types: code outside the core that names one has chosen a kind
/// instead of calling the `Memory` interface.
const MEMORY_TYPES: &[&str] = &[
    "AttentionCache",
    "IswaCache",
    "IswaPart",
    "HybridCache",
    "HybridAttention",
    "HybridRecurrent",
    "RecurrentMemory",
];

/// The names `Memory::kind` returns, as string literals.
const KIND_NAMES: &[&str] = &[
    "\"kv\"",
    "\"recurrent\"",
    "\"kv-streams\"",
    "\"iswa\"",
    "\"hybrid\"",
];

/// Where the code of the `.rs` files under `root` (comments and test modules left out) names
/// a live memory's own type, or compares a memory's `kind()` with a kind's name.
fn kind_choices(root: &Path) -> Vec<String> {
    let mut found = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let text = fs::read_to_string(&path).unwrap();
            for (i, line) in code_of(&text).iter().enumerate() {
                let named = MEMORY_TYPES.iter().find(|t| {
                    line.match_indices(*t).any(|(at, _)| {
                        let before = line[..at].chars().next_back();
                        let after = line[at + t.len()..].chars().next();
                        !before.is_some_and(is_ident) && !after.is_some_and(is_ident)
                    })
                });
                let compared =
                    line.contains(".kind()") && KIND_NAMES.iter().any(|k| line.contains(k));
                if let Some(t) = named {
                    found.push(format!("{}:{}: names {t}", path.display(), i + 1));
                } else if compared {
                    found.push(format!(
                        "{}:{}: compares kind() with a kind's name",
                        path.display(),
                        i + 1
                    ));
                }
            }
        }
    }
    found.sort();
    found
}

#[test]
fn no_choice_of_memory_kind_outside_the_core() {
    let mut found = Vec::new();
    for root in [
        "src",
        "crates/prompt-store/src",
        "crates/prompt-store-redis/src",
    ] {
        found.extend(kind_choices(&workspace().join(root)));
    }
    assert!(found.is_empty(), "\n{}", found.join("\n"));
}

#[test]
fn the_kind_check_sees_a_named_memory_type_and_a_compared_kind() {
    let dir = std::env::temp_dir().join(format!("kind-choices-{}", std::process::id()));
    fs::create_dir_all(&dir).unwrap();
    fs::write(
        dir.join("a.rs"),
        "// an IswaCache in a comment is fine\nfn f(m: &llama_kv_cache::IswaCache) {}\n\
         fn g(m: &dyn Memory) -> bool { m.kind() == \"hybrid\" }\nstruct MyIswaCacheView;\n",
    )
    .unwrap();
    let found = kind_choices(&dir);
    fs::remove_dir_all(&dir).unwrap();
    assert_eq!(found.len(), 2, "{found:?}");
    assert!(found[0].ends_with("a.rs:2: names IswaCache"), "{found:?}");
    assert!(
        found[1].ends_with("a.rs:3: compares kind() with a kind's name"),
        "{found:?}"
    );
}
