use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // A vendored protoc keeps the build free of system packages.
    // SAFETY: build scripts are single-threaded; nothing else reads the environment concurrently.
    unsafe { std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?) };

    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let protos = ["common", "scheduler", "worker", "gateway", "head"]
        .map(|name| root.join(format!("nomad/v1/{name}.proto")))
        .into_iter()
        .chain([root.join("jaeger/api_v3/query.proto")])
        .collect::<Vec<_>>();
    // The protos live outside this crate, so cargo must be told to watch them.
    for proto in &protos {
        println!("cargo:rerun-if-changed={}", proto.display());
    }
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("nomad_descriptor.bin"))
        .compile_protos(&protos, &[root])?;
    Ok(())
}
