use super::*;

fn load(yaml: &str) -> Result<Vec<ToolConfig>, ToolConfigError> {
    load_tools(
        &ConfigFile::from_yaml_str(yaml),
        &ToolManagerConfig::default(),
    )
}

fn error(yaml: &str) -> String {
    load(yaml).unwrap_err().to_string()
}

/// Each config is refused with a message that says what its case expects.
fn refused_saying(cases: &[(&str, &str)]) {
    for (yaml, expected) in cases {
        let message = error(yaml);
        assert!(message.contains(expected), "{yaml}\n{message}");
    }
}

#[test]
fn builtin_tools_take_the_managers_defaults() {
    let tools = load("tools:\n  - name: mlp\n    kind: mlp\n    source: /models/mlp\n").unwrap();
    let t = &tools[0];
    assert_eq!((t.batch_size, t.max_devices, t.max_pending), (8, 1, 1024));
    assert_eq!(t.execute_timeout, Duration::from_secs(300));
    assert!(t.python.is_none() && !t.continuous);
    let g = load("tools:\n  - name: g\n    kind: generate\n    source: /m\n").unwrap();
    assert!(g[0].continuous);
    assert_eq!(g[0].max_running, Some(DEFAULT_MAX_RUNNING));
}

#[test]
fn bad_builtin_entries_are_named_with_what_is_wrong() {
    let cases = [
        (
            "tools:\n  - {name: a, kind: mlp, source: /m}\n  - {name: a, kind: embed, source: /m}\n",
            "tools[1]: tool name `a` is taken by tools[0] too",
        ),
        (
            "tools:\n  - {name: b, kind: vision, source: /m}\n",
            "tools[0] (b): unknown kind \"vision\"",
        ),
        (
            "tools:\n  - {name: b, kind: python, source: /m}\n",
            "unknown kind \"python\"",
        ),
        (
            "tools:\n  - {name: c, kind: mlp, source: /m, batch_size: 0}\n",
            "`batch_size` must be at least 1",
        ),
        (
            "tools:\n  - {name: e, kind: embed, source: /m, max_running: 4}\n",
            "tools[0] (e): `max_running` applies to continuous kinds (generate), not embed",
        ),
        (
            "tools:\n  - {name: m, kind: mlp, source: /m, kv_budget_bytes: 9}\n",
            "`kv_budget_bytes` applies to continuous kinds",
        ),
        (
            "tools:\n  - {name: e, kind: embed, source: /m, dense_prefill: true}\n",
            "`dense_prefill` applies to continuous kinds",
        ),
        (
            "tools:\n  - {name: g, kind: generate, source: /m, max_running: 0}\n",
            "`max_running` must be at least 1",
        ),
        (
            "tools:\n  - {name: m, kind: mlp, source: /m, batch: 3}\n",
            "tools[0]: unknown key `batch`; the keys here are: name, kind, source",
        ),
        (
            "tools:\n  - {name: m, source: /m}\n",
            "tools[0]: an entry needs `kind`",
        ),
    ];
    refused_saying(&cases);
}

#[test]
fn fmod_models_read_the_originals_keys_and_nomads_additions() {
    let tools = load(
        "model_host:\n  python: /opt/py3.12/bin/python\n\
         fmod_models:\n\
         \x20 - model_class: my_pkg.models.Surrogate\n\
         \x20   name_or_path: ./weights\n\
         \x20   env: [\"nomad-scifm==0.2.1\", \"my_pkg @ file:///src/my_pkg\"]\n\
         \x20 - model_class: my_pkg.models.Surrogate\n\
         \x20   name_or_path: hf://org/heat-2d@v1\n\
         \x20   batch_size: 16\n\
         \x20   env: numpy\n\
         \x20   python: /usr/bin/python3.13\n",
    )
    .unwrap();
    let (a, b) = (&tools[0], &tools[1]);
    assert_eq!(
        (a.name.as_str(), b.name.as_str()),
        ("Surrogate", "org---heat_2d")
    );
    assert_eq!(a.kind, "python");
    assert!(a.batch_size_from_model && a.batch_size == 1);
    assert!(!b.batch_size_from_model && b.batch_size == 16);
    let pa = a.python.as_ref().unwrap();
    assert_eq!(pa.entry(), nomad_proto::v1::python_model::Entry::ModelClass);
    assert_eq!(pa.target, "my_pkg.models.Surrogate");
    assert_eq!(
        pa.requirements,
        ["nomad-scifm==0.2.1", "my_pkg @ file:///src/my_pkg"]
    );
    assert_eq!(pa.python, "/opt/py3.12/bin/python");
    assert_eq!(pa.batch_timeout_ms, 270_000);
    let pb = b.python.as_ref().unwrap();
    assert_eq!(
        (pb.requirements.clone(), pb.python.as_str()),
        (vec!["numpy".to_owned()], "/usr/bin/python3.13")
    );
    let spec = a.model_spec();
    assert_eq!(
        (spec.kind.as_str(), spec.source.as_str()),
        ("python", "./weights")
    );
    assert_eq!(spec.python.as_ref(), a.python.as_ref());
}

#[test]
fn callables_are_named_as_the_original_names_them() {
    let tools = load(
        "tools:\n\
         \x20 - my_pkg.tools.search_pubchem\n\
         \x20 - tool: my_pkg.tools.make_scaler\n\
         \x20   tool_kwargs: {factor: 3}\n\
         \x20 - tool: my_pkg.tools.add\n\
         \x20   name: add\n\
         \x20   env: numpy\n\
         \x20 - {name: mlp, kind: mlp, source: /m}\n",
    )
    .unwrap();
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        names,
        ["search_pubchem", "my_pkgptoolspmake_scaler", "add", "mlp"]
    );
    let scaler = tools[1].python.as_ref().unwrap();
    assert_eq!(
        scaler.entry(),
        nomad_proto::v1::python_model::Entry::Callable
    );
    assert_eq!(scaler.tool_kwargs_json, r#"{"factor":3}"#);
    assert!(tools[0].source.is_empty() && !tools[0].batch_size_from_model);
    assert_eq!(tools[0].batch_size, 16);
}

#[test]
fn bad_python_entries_are_named_with_what_is_wrong() {
    let cases = [
        (
            "fmod_models:\n  - {model_class: Surrogate, name_or_path: /w}\n",
            "fmod_models[0]: `model_class` must be a dotted path",
        ),
        (
            "fmod_models:\n  - {model_class: a.B, name_or_path: /w, batch_sise: 4}\n",
            "fmod_models[0]: unknown key `batch_sise` (did you mean `batch_size`?)",
        ),
        (
            "fmod_models:\n  - {model_class: a.B, name_or_path: ''}\n",
            "`name_or_path` is empty",
        ),
        (
            "fmod_models:\n  - {model_class: a.B, name_or_path: /w}\n  - {model_class: c.B, name_or_path: /v}\n",
            "fmod_models[1]: tool name `B` is taken by fmod_models[0] too",
        ),
        (
            "fmod_models:\n  - {model_class: a.B, name_or_path: /w, env: ['']}\n",
            "`env` holds an empty requirement",
        ),
        (
            "tools:\n  - not-dotted\n",
            "tools[0]: `tool` must be a dotted path",
        ),
        (
            "tools:\n  - {tool: a.f, tool_kwargs: 3}\n",
            "tools[0].tool_kwargs: invalid type",
        ),
    ];
    refused_saying(&cases);
}

#[test]
fn the_originals_tool_manager_block_is_accepted() {
    let file = ConfigFile::from_yaml_str(
        "tool_manager:\n  enabled: true\n  idle_seconds: 120\n  max_pending_per_tool: 50000\n",
    );
    let manager: ToolManagerConfig = file.section("tool_manager").unwrap();
    assert_eq!(
        (manager.idle_seconds, manager.max_pending_per_tool),
        (120.0, 50000)
    );
    let off = ConfigFile::from_yaml_str("tool_manager:\n  enabled: false\n");
    let manager: ToolManagerConfig = off.section("tool_manager").unwrap();
    assert!(
        load_tools(&off, &manager)
            .unwrap_err()
            .to_string()
            .contains("tool_manager.enabled: false is not supported")
    );
}

#[test]
fn sanitize_follows_the_original() {
    assert_eq!(python::sanitize_mcp_name("my.mod/x y"), "mypmod---x_y");
}
