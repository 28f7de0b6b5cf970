# Sourced by wheelhouse.sh and wheelhouse-test.sh (from the checkout's root): the GPU box's own versions, from its
# image's pip list (Python 3.12.3, torch 2.11.0). The wheelhouse resolves the kit against them and the rehearsal's
# stand-in image installs them; a package named here wins over requirements.txt's pin (the box keeps what it has).
BOX=${BOX:-"numpy==2.5.2 transformers==5.17.0 tokenizers==0.23.2 huggingface_hub==1.33.0 safetensors==0.8.0
torchaudio==2.11.0"}
_name() { echo "$1" | tr '_A-Z' '-a-z'; }
# box_pin NAME: its pin in BOX, else in requirements.txt (- and _ alike); fails where neither pins it
box_pin() {
    local want line; want=$(_name "$1")
    for line in $BOX $(grep -E '^[A-Za-z]' requirements.txt); do
        [ "$(_name "${line%%==*}")" = "$want" ] && { echo "$line"; return 0; }
    done
    return 1
}
